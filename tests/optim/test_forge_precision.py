"""bf16 weights with stochastic rounding, bf16 optimizer state: unbiased rounding and stated error bounds."""

import copy

import pytest
import torch

from memgrad_hf.kernels.forge import gram_pays, linear_grad_norm_sq, norm_sq, round_to_bf16_stochastic
from memgrad_hf.optim import ForgeAdamW, ForgeLion
from tests.tiny_models import tiny_model


def test_stochastic_rounding_is_unbiased_and_reproducible():
    x = torch.full((200_000,), 1.0 + 1e-3)  # between bf16 neighbours 1.0 and 1.0078125
    r = round_to_bf16_stochastic(x, seed=1)
    assert set(r.unique().tolist()) == {1.0, 1.0078125}
    assert abs(r.double().mean().item() - (1.0 + 1e-3)) < 5e-5  # ~4 sigma of the binomial noise
    assert torch.equal(r, round_to_bf16_stochastic(x, seed=1))
    assert not torch.equal(r, round_to_bf16_stochastic(x, seed=2))
    assert x.to(torch.bfloat16).unique().tolist() == [1.0]  # nearest rounding loses the offset entirely
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -2.5])
    assert torch.equal(round_to_bf16_stochastic(special, 0).float(), special)


def test_small_updates_survive_in_bf16_only_with_stochastic_rounding():
    # 100 AdamW steps of lr 1e-4 on a bf16 weight of 1.0: each step is far below bf16's spacing (2^-7).
    results = {}
    for sr in (False, True):
        w = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        model = torch.nn.Module()
        model.w = w
        opt = ForgeAdamW([w], model=model, lr=1e-4, weight_decay=0.0, stochastic_rounding=sr)
        for _ in range(100):
            (w.float().sum() * -1.0).backward()  # constant gradient -1: AdamW moves each weight up by lr
            opt.step()
        results[sr] = w.float().mean().item()
    assert results[False] == 1.0  # nearest rounding: stuck
    assert abs(results[True] - 1.01) < 1e-3  # stochastic rounding: the expected 100 * 1e-4


def test_bf16_state_stays_within_stated_bound_of_fp32_state():
    """Stated bound: bf16 state carries a relative error of at most 2^-8 on m and v (v rounded stochastically),
    so each AdamW step moves a weight by lr·m/sqrt(v) within ~2^-7 relative of the fp32-state step; here (no gradient
    changing sign between the runs) after n steps every weight is within n·lr·2^-6 (2x margin) of the fp32-state
    run. The general bound is per step: the test below."""
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 100, (4, 16))
    opts = [ForgeAdamW(m.parameters(), model=m, lr=1e-2, state_dtype=dt)
            for m, dt in ((model, "bf16"), (ref, torch.float32))]
    for _ in range(6):
        for m, o in zip((model, ref), opts, strict=True):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    assert all(v.dtype == torch.bfloat16 for st in opts[0].state.values() for k, v in st.items() if k != "step")
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert 0 < worst <= 6 * 1e-2 * 2**-6


def test_bf16_state_survives_a_state_dict_round_trip():
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3, state_dtype="bf16")
    ids = torch.randint(1, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt2 = ForgeAdamW(model.parameters(), model=model, lr=1e-3, state_dtype="bf16")
    opt2.load_state_dict(sd)
    for p in model.parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt2.state[p][k].dtype == torch.bfloat16
            assert torch.equal(opt2.state[p][k], opt.state[p][k])


def test_state_dtype_follows_the_weights_by_default_and_fp32_state_for_bf16_says_what_it_costs(caplog):
    import logging

    model = tiny_model("llama").to(torch.bfloat16)
    fp32_model = tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        auto = ForgeAdamW(model.parameters(), model=model)  # like torch.optim: bf16 state for bf16 weights
        assert {auto._state_dtype_for(p) for p in model.parameters()} == {torch.bfloat16}
        auto.detach()
        auto32 = ForgeAdamW(fp32_model.parameters(), model=fp32_model, state_dtype="auto")
        assert {auto32._state_dtype_for(p) for p in fp32_model.parameters()} == {torch.float32}
        auto32.detach()
        ForgeAdamW(model.parameters(), model=model, state_dtype="bf16").detach()
    assert "state_dtype" not in caplog.text
    with caplog.at_level(logging.INFO, logger="memgrad_hf.forge"):  # (an explicit choice: said at INFO)
        ForgeAdamW(model.parameters(), model=model, state_dtype="fp32").detach()  # twice torch's state: said
    assert "twice the state" in caplog.text


def test_weight_gradient_norm_through_token_grams_equals_fp64():
    # ‖dyᵀx‖² = Σ (dy dyᵀ) ⊙ (x xᵀ): the clipping norm pass takes it where it costs fewer flops than dW itself
    g = torch.Generator().manual_seed(0)
    for n, out_f, in_f in [(96, 2000, 64), (40, 48, 200), (1, 10, 10)]:
        x = torch.randn(n, in_f, generator=g) + 3 * torch.randn(in_f, generator=g)  # correlated rows, as activations
        dy = torch.randn(n, out_f, generator=g) / n
        ref = ((dy.double().t() @ x.double()) ** 2).sum()
        got = linear_grad_norm_sq(dy, x)
        assert got.dtype == torch.float64 and abs(got - ref) <= 1e-6 * ref, (n, out_f, in_f)
        assert abs(norm_sq(dy.t() @ x) - ref) <= 1e-6 * ref  # the tile path it replaces
    dy[0, 5] = float("nan")
    assert not torch.isfinite(linear_grad_norm_sq(dy, x))
    assert gram_pays(256, 32000, 512) and gram_pays(1024, 11008, 4096)  # an LM head; a 7B MLP at batch 1
    assert not gram_pays(256, 512, 512) and not gram_pays(8192, 11008, 4096)  # square at N = d/2; long sequences


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["no_clip", "exact_clip"])
@pytest.mark.parametrize("rule", ["adamw", "lion", "sgd"])
def test_fp64_models_are_updated_in_fp64(rule, max_grad_norm):
    # an fp64 model gets torch.optim's fp64 arithmetic (state included), not an fp32 update rounded back
    import memgrad_hf
    from memgrad_hf.optim import ForgeSGD
    from tests.optim.test_forge_trainer import _RefLion

    model = memgrad_hf.patch_model(tiny_model("llama").double())
    ref = copy.deepcopy(model)
    opt, ref_opt = {
        "adamw": lambda: (ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=max_grad_norm),
                          torch.optim.AdamW(ref.parameters(), lr=1e-2)),
        "lion": lambda: (ForgeLion(model.parameters(), model=model, lr=1e-3, weight_decay=0.1,
                                   max_grad_norm=max_grad_norm),
                         _RefLion(ref.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
        "sgd": lambda: (ForgeSGD(model.parameters(), model=model, lr=0.5, momentum=0.9, max_grad_norm=max_grad_norm),
                        torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)),
    }[rule]()
    for step in range(3):
        ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        ref_loss = ref(input_ids=ids, labels=ids).loss
        assert loss.dtype == torch.float64 and abs(loss.item() - ref_loss.item()) < 1e-12
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        ref_opt.step()
        ref_opt.zero_grad()
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert all(v.dtype == torch.float64 for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)
               and k != "step")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p - q).abs().max() <= 1e-11 * q.abs().max(), name


def _one_step_each(cls, model, opt, ids, lr, state_dtypes):
    """``opt`` detached; from a copy of ``model`` and ``opt``'s state, one step on ``ids`` per state dtype: the
    copies after it."""
    state = copy.deepcopy(opt.state_dict())
    opt.detach()
    moved = []
    for dt in state_dtypes:
        m = copy.deepcopy(model)
        o = cls(m.parameters(), model=m, lr=lr, state_dtype=dt)
        o.load_state_dict(copy.deepcopy(state))  # (as torch.optim, loading may alias the given tensors)
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
        o.detach()
        moved.append(m)
    return moved


@pytest.mark.parametrize("state_dtype,bound", [("bf16", 2**-6), ("8bit", 2**-2)])
def test_one_step_from_the_same_weights_and_state_is_within_the_stated_bound(monkeypatch, state_dtype, bound):
    """The stated bound is per step: from the same weights and (fp32) state, one step with the state kept in
    ``state_dtype`` moves every weight within lr·bound of the fp32-state step, including elements whose first
    gradient arrives in that step (Adam's first update is ±lr whatever the gradient's size). Over several steps the
    runs also drift apart as any perturbation makes them: an element whose gradient starts near zero can take either
    sign (at vocab 8192 fp32 state from weights scaled by 1+1e-5 ends as far from the fp32 run as bf16 state)."""
    import memgrad_hf.optim.forge as forge_mod

    monkeypatch.setattr(forge_mod, "_MIN_8BIT_NUMEL", 0)  # the tiny model's matrices are below the default
    lr = 1e-2
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    opt = ForgeAdamW(model.parameters(), model=model, lr=lr)
    for _ in range(3):  # a state of some history, ids 1-49 only: the others' rows get their first gradient below
        ids = torch.randint(1, 50, (4, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    moved = _one_step_each(ForgeAdamW, model, opt, torch.randint(1, 100, (4, 16), generator=g), lr,
                           (state_dtype, torch.float32))
    worst = max((p - q).abs().max().item() for p, q in zip(*(m.parameters() for m in moved), strict=True))
    assert 0 < worst <= lr * bound


@pytest.mark.parametrize("state_dtype", ["bf16", "8bit"])
def test_lions_one_step_from_low_precision_state_differs_only_by_sign_flips(monkeypatch, state_dtype):
    """Lion steps by a sign: AdamW's per-step bound has no Lion counterpart (docs). An element of the
    low-precision-state step either equals the fp32-state step or took the other sign (2·lr away), and only where
    ``β1·m + (1-β1)·g`` is near 0: a small fraction of the elements."""
    import memgrad_hf.optim.forge as forge_mod

    monkeypatch.setattr(forge_mod, "_MIN_8BIT_NUMEL", 0)
    lr = 1e-3
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    opt = ForgeLion(model.parameters(), model=model, lr=lr)
    for _ in range(5):
        ids = torch.randint(1, 100, (4, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    moved = [torch.cat([p.detach().flatten() for p in m.parameters()])
             for m in _one_step_each(ForgeLion, model, opt, torch.randint(1, 100, (4, 16), generator=g), lr,
                                     (state_dtype, torch.float32))]
    diff = (moved[0] - moved[1]).abs() / lr
    flipped = diff > 1e-3
    assert torch.allclose(diff[flipped], torch.full_like(diff[flipped], 2.0), rtol=1e-3)  # a sign, not a size
    assert flipped.float().mean() < 0.01
