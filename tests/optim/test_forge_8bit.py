"""8-bit optimizer state (block-scaled e3m4 / e3m5 codes): stated error bounds, unbiased rounding, checkpoints."""

import copy

import pytest
import torch

import memgrad_hf.optim.forge as forge_mod
from memgrad_hf.kernels.state_codes import (
    Q_BLOCK,
    Q_DTYPE,
    decode,
    dequantize_8bit,
    encode,
    mantissa_bits,
    q_max,
    quantize_8bit,
    scale_shape,
)
from memgrad_hf.optim import ForgeAdamW, ForgeLion
from tests.tiny_models import tiny_model


def _wide_range(rows: int = 8, cols: int = 200) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # magnitudes spread over 8 decades inside each block: the case linear int8 gets wrong
    return torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(-6, 2, (rows, cols), generator=g).float()


@pytest.mark.parametrize("positive", [False, True], ids=["signed_e3m4", "positive_e3m5"])
def test_quantize_round_trip_within_stated_bound(positive):
    x = _wide_range()
    x = x.abs() if positive else x
    m = mantissa_bits(positive)
    codes, scale = quantize_8bit(x, positive=positive)
    assert codes.dtype == Q_DTYPE and codes.shape == x.shape
    assert scale.shape == scale_shape(x.shape) == (8, -(-200 // Q_BLOCK))
    deq = dequantize_8bit(codes, scale, positive=positive)
    blk_max = torch.nn.functional.pad(x.abs(), (0, 56)).reshape(8, 4, 64).amax(-1).repeat_interleave(64, -1)[:, :200]
    err = (deq - x).abs()
    floor = 2 ** (-6 - m) if positive else 2 ** (-7 - m)  # positive: the smallest values are lifted to a code
    assert (err <= 2 ** -(m + 1) * x.abs() + floor * blk_max + 1e-12).all()
    # and no looser than that: the relative bound is reached (the format has m mantissa bits, not more)
    assert (err > 2 ** -(m + 2) * x.abs()).any()
    codes_sr, scale_sr = quantize_8bit(x, seed=3, positive=positive)
    err_sr = (dequantize_8bit(codes_sr, scale_sr, positive=positive) - x).abs()
    assert (err_sr < 2**-m * x.abs() + 2 ** (-6 - m) * blk_max + 1e-12).all()
    # a linear int8 code would flush most of these to zero; the exponent keeps every value above ~2^-12 of its
    # block's largest (and a positive one, a denominator, is never flushed)
    kept = x.abs() > 2**-11 * blk_max
    assert (deq[kept] != 0).all()
    if positive:
        assert (deq[x > 0] > 0).all()
    else:
        assert (torch.sign(deq[kept]) == torch.sign(x[kept])).all()


def test_every_code_decodes_and_encodes_back():
    """The 256 codes of each format: distinct, ordered values that encode back to themselves (the signed format's
    -0.0 too), in the eager table, the element-wise decode and the compiled update's decode alike."""
    from memgrad_hf.kernels import forge_compiled as C

    codes = torch.arange(256, dtype=torch.uint8)
    for positive in (False, True):
        vals = decode(codes, positive)
        assert torch.equal(vals, dequantize_8bit(codes[None], torch.ones(1, 4), positive=positive)[0])
        assert torch.equal(C._dequantize(codes.view(4, 64), torch.ones(4), positive).reshape(-1), vals)
        mags = vals if positive else vals[:128]
        assert (mags.diff() > 0).all() and mags.max() == q_max(positive)
        assert torch.equal(encode(vals, None, positive), codes)


def test_stochastic_8bit_rounding_is_unbiased_and_positive_floors():
    for positive in (False, True):
        x = torch.full((1, 64 * 4000), 1.1)
        x[0, ::64] = q_max(positive) / 0.9  # block max: scale 1/0.9 maps 1.1 to 0.99, between two codes
        codes, scale = quantize_8bit(x, seed=5, positive=positive)
        deq = dequantize_8bit(codes, scale, positive=positive)
        body = deq.reshape(-1, 64)[:, 1:]
        assert len(body.unique()) == 2
        assert abs(body.double().mean().item() - 1.1) < 5e-4  # ~5 sigma of the binomial noise
        near = dequantize_8bit(*quantize_8bit(x, positive=positive), positive=positive).reshape(-1, 64)[:, 1:]
        assert abs(near.double().mean().item() - 1.1) > 2e-3  # nearest rounding is biased here
    tiny = torch.tensor([[1.0] + [1e-12] * 63])
    assert (dequantize_8bit(*quantize_8bit(tiny, positive=True), positive=True) > 0).all()
    assert (dequantize_8bit(*quantize_8bit(tiny))[0, 1:] == 0).all()


@pytest.mark.parametrize("seed", [None, 7], ids=["nearest", "stochastic"])
def test_positive_keeps_zeros_zero_in_every_implementation(seed):
    """sqrt(v) = 0 (no gradient yet) must stay 0: the smallest code of an all-zero block (scale 1) is ~5e-4 in
    absolute terms, far above the sqrt(v) of the small gradients that come later, and would hold their updates
    back for thousands of steps. The eager path and the compiled CPU loop's quantizer alike."""
    from memgrad_hf.kernels import forge_compiled as C

    x = torch.tensor([[0.0] * 64, [1.0] + [0.0] * 31 + [1e-12] * 32])
    deq = dequantize_8bit(*quantize_8bit(x, seed, positive=True), positive=True)
    assert (deq[x == 0] == 0).all() and (deq[x > 0] > 0).all()
    key = None if seed is None else torch.tensor(seed, dtype=torch.int32)
    codes, scale = C._quantize(x, key, positive=True)  # [blocks, Q_BLOCK] rows
    deq = C._dequantize(codes, scale, positive=True)
    assert (deq[x == 0] == 0).all() and (deq[x > 0] > 0).all()


def test_compiled_quantizer_equals_eager_code_for_code():
    """The compiled update's quantizer (traced from the same element-wise code) against the eager one, with the
    hashed noise of the same seed and offsets."""
    from memgrad_hf.kernels import forge as K
    from memgrad_hf.kernels import forge_compiled as C

    x = _wide_range(8, 128)
    for positive, seed in ((False, None), (True, 11)):
        x = x.abs() if positive else x
        want = quantize_8bit(x, seed, positive=positive)
        key = None if seed is None else torch.tensor(K.as_int32(K.noise_key(seed)), dtype=torch.int32)
        got = C._quantize(x.view(-1, Q_BLOCK), key, positive)
        assert torch.equal(got[0].view(8, 128), want[0]) and torch.equal(got[1].view(8, 2), want[1])


def test_rows_whose_gradient_starts_late_move_as_with_fp32_state(monkeypatch):
    """Embedding rows of tokens first seen at step 3: their 8-bit state was all zero until then. Their updates must
    follow the fp32-state run's (a zero state once got the smallest code, 2^-9 absolute, as its sqrt(v): the first
    updates of such rows came out ~100x too small)."""
    monkeypatch.setattr(forge_mod, "_MIN_8BIT_NUMEL", 0)
    torch.manual_seed(0)
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    opts = [ForgeAdamW(m.parameters(), model=m, lr=1e-3, state_dtype=dt)
            for m, dt in ((model, "8bit"), (ref, torch.float32))]
    early, late = torch.randint(1, 50, (4, 16)), torch.randint(50, 100, (4, 16))
    start = model.get_input_embeddings().weight.detach().clone()
    for ids in (early, early, late, late):
        for m, o in zip((model, ref), opts, strict=True):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    rows = late.unique()
    moved = (ref.get_input_embeddings().weight - start)[rows]
    ours = (model.get_input_embeddings().weight - start)[rows]
    assert moved.abs().mean() > 1e-3  # two AdamW steps of ~lr each
    assert ((ours - moved).norm() / moved.norm()).item() < 0.1, ((ours - moved).norm() / moved.norm()).item()


@pytest.mark.parametrize("lr", [1e-2, 1e-3])
def test_8bit_state_stays_within_stated_bound_of_fp32_state(monkeypatch, lr):
    """Stated bound: m is kept to 2^-4 relative, sqrt(v) to 2^-3 (stochastic), so each AdamW step is within
    2^-2·lr of the fp32-state step; here after n steps every weight is within n·lr·2^-2 of the fp32-state run (the
    general, per-step bound: test_forge_precision.py)."""
    monkeypatch.setattr(forge_mod, "_MIN_8BIT_NUMEL", 0)  # the tiny model's matrices are below the default
    torch.manual_seed(0)
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 100, (4, 16))
    opts = [ForgeAdamW(m.parameters(), model=m, lr=lr, state_dtype=dt)
            for m, dt in ((model, "8bit"), (ref, torch.float32))]
    n = 6
    for _ in range(n):
        for m, o in zip((model, ref), opts, strict=True):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    dtypes = {p.dim(): st["exp_avg"].dtype for p, st in opts[0].state.items()}
    assert dtypes == {2: Q_DTYPE, 1: torch.float32}  # matrices in 8 bits, norms in fp32
    assert all(torch.isfinite(p).all() for p in model.parameters())
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert 0 < worst <= n * lr * 2**-2


def test_8bit_state_checkpoint_resume_is_bit_identical(monkeypatch):
    monkeypatch.setattr(forge_mod, "_MIN_8BIT_NUMEL", 0)
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (2, 8))
    for cls in (ForgeAdamW, ForgeLion):
        a = tiny_model("llama")
        opt_a = cls(a.parameters(), model=a, lr=1e-3, state_dtype="8bit")
        for _ in range(2):
            a(input_ids=ids, labels=ids).loss.backward()
            opt_a.step()
        sd = copy.deepcopy(opt_a.state_dict())
        b = copy.deepcopy(a)
        for _ in range(2):
            a(input_ids=ids, labels=ids).loss.backward()
            opt_a.step()
        opt_a.detach()
        opt_b = cls(b.parameters(), model=b, lr=1e-3, state_dtype="8bit")
        opt_b.load_state_dict(sd)
        assert any(k.endswith(".scale") for st in opt_b.state.values() for k in st)
        for _ in range(2):
            b(input_ids=ids, labels=ids).loss.backward()
            opt_b.step()
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q)
        opt_b.detach()


def test_bad_state_dtype_is_a_clear_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        ForgeAdamW(model.parameters(), model=model, state_dtype="int4")


def _train(model, opt, ids, steps):
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def _two_8bit_steps():
    """A tiny Llama after two 8-bit-state AdamW steps: the model, its optimizer, the batch and a saved state dict."""
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3, state_dtype="8bit")
    _train(model, opt, ids, 2)
    return model, opt, ids, copy.deepcopy(opt.state_dict())


def _as_legacy(sd):
    """``sd`` as the 8-bit state was saved before 2026-11-27: float8-e4m3 codes of each block over its max / 224."""
    sd = copy.deepcopy(sd)
    for st in sd["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            if name + ".scale" in st:  # (before 2026-11-27 the codes were saved under the moment's own name)
                x = dequantize_8bit(st.pop(name + ".codes"), st[name + ".scale"], positive=name == "exp_avg_sq")
                blocks = torch.nn.functional.pad(x, (0, (-x.shape[-1]) % Q_BLOCK)).reshape(*x.shape[:-1], -1, Q_BLOCK)
                amax = blocks.abs().amax(-1)
                scale = torch.where(amax > 0, amax / 224.0, torch.ones_like(amax))
                codes = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(*x.shape[:-1], -1)
                st[name], st[name + ".scale"] = codes[..., :x.shape[-1]], scale
    return sd


def test_8bit_checkpoint_from_before_2026_11_27_resumes_in_the_current_codes(monkeypatch):
    """A checkpoint with e4m3 codes loads: its state re-encoded (within both formats' rounding of the saved
    values), and training goes on as from the current format's checkpoint (within the 8-bit bound)."""
    monkeypatch.setattr(forge_mod, "_MIN_8BIT_NUMEL", 0)
    a, opt_a, ids, sd = _two_8bit_steps()
    b = copy.deepcopy(a)
    opt_b = ForgeAdamW(b.parameters(), model=b, lr=1e-3, state_dtype="8bit")
    opt_b.load_state_dict(_as_legacy(sd))
    converted = 0
    for (i, saved), st in zip(sd["state"].items(), opt_b.state.values(), strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            if name + ".scale" in saved:
                assert st[name].dtype == Q_DTYPE, i
                pos = name == "exp_avg_sq"
                want = dequantize_8bit(saved[name + ".codes"], saved[name + ".scale"], positive=pos)
                got = dequantize_8bit(st[name], st[name + ".scale"], positive=pos)
                blk = want.abs().amax()
                assert ((got - want).abs() <= 2**-3 * want.abs() + 2**-9 * blk).all(), (i, name)
                converted += 1
    assert converted > 0
    _train(a, opt_a, ids, 2)
    _train(b, opt_b, ids, 2)
    worst = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert worst <= 2 * 1e-3 * 2**-2


def test_resume_with_another_state_dtype_converts_the_state(monkeypatch):
    """8-bit state loaded by an fp32-state optimizer comes back as its exact values (sqrt(v) squared), and fp32
    state loaded by an 8-bit one as the codes that quantizing it gives; both train on."""
    monkeypatch.setattr(forge_mod, "_MIN_8BIT_NUMEL", 0)
    a, opt_a, ids, sd8 = _two_8bit_steps()
    b = copy.deepcopy(a)
    opt_b = ForgeAdamW(b.parameters(), model=b, lr=1e-3, state_dtype=torch.float32)
    opt_b.load_state_dict(sd8)
    sd32 = copy.deepcopy(opt_b.state_dict())
    for saved, st in zip(sd8["state"].values(), opt_b.state.values(), strict=True):
        assert not any(k.endswith(".scale") for k in st)
        if "exp_avg.scale" in saved:
            assert torch.equal(st["exp_avg"], dequantize_8bit(saved["exp_avg.codes"], saved["exp_avg.scale"]))
            root = dequantize_8bit(saved["exp_avg_sq.codes"], saved["exp_avg_sq.scale"], positive=True)
            assert torch.equal(st["exp_avg_sq"], root.square())
        else:
            assert all(torch.equal(st[k], saved[k]) for k in ("exp_avg", "exp_avg_sq"))
    c = copy.deepcopy(a)
    opt_c = ForgeAdamW(c.parameters(), model=c, lr=1e-3, state_dtype="8bit")
    opt_c.load_state_dict(sd32)
    for saved, st in zip(sd32["state"].values(), opt_c.state.values(), strict=True):
        if st["exp_avg"].dtype == Q_DTYPE:
            codes, scale = quantize_8bit(saved["exp_avg_sq"].sqrt(), positive=True)
            assert torch.equal(st["exp_avg_sq"], codes) and torch.equal(st["exp_avg_sq.scale"], scale)
            assert torch.equal(st["exp_avg"], quantize_8bit(saved["exp_avg"])[0])
    _train(b, opt_b, ids, 1)
    _train(c, opt_c, ids, 1)
    assert all(torch.isfinite(p).all() for p in (*b.parameters(), *c.parameters()))
    for o in (opt_a, opt_b, opt_c):
        o.detach()


def test_8bit_state_dict_is_not_taken_for_moments_by_torch_adamw(monkeypatch):
    """torch.optim casts a saved state tensor to the weight's dtype on load: 8-bit codes under the moment's own name
    would become moments of 0-255 and train on silently. Saved under their own name they cannot be used: torch's
    AdamW fails at its first step; the 8-bit state goes to torch through an fp32-state FORGE optimizer, exactly."""
    monkeypatch.setattr(forge_mod, "_MIN_8BIT_NUMEL", 0)
    a, opt_a, ids, sd8 = _two_8bit_steps()
    assert any(k.endswith(".codes") for st in sd8["state"].values() for k in st)
    b = copy.deepcopy(a)
    opt_a.detach()
    torch_opt = torch.optim.AdamW(b.parameters(), lr=1e-3)
    torch_opt.load_state_dict(sd8)
    b(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(KeyError, match="exp_avg"):
        torch_opt.step()
    c = copy.deepcopy(a)
    opt_c = ForgeAdamW(c.parameters(), model=c, lr=1e-3, state_dtype=torch.float32)
    opt_c.load_state_dict(sd8)
    torch_opt = torch.optim.AdamW(copy.deepcopy(a).parameters(), lr=1e-3)
    torch_opt.load_state_dict(opt_c.state_dict())
    for saved, st in zip(opt_c.state.values(), torch_opt.state.values(), strict=True):
        assert all(torch.equal(st[k], saved[k]) for k in ("exp_avg", "exp_avg_sq"))
    opt_c.detach()
    # or in one call on the saved dict (a checkpoint's optimizer.pt): the same decoded state, and torch's step runs
    from memgrad_hf.optim import to_torch_state_dict

    converted = to_torch_state_dict(sd8)
    assert "forge" not in converted and not any("." in k for st in converted["state"].values() for k in st)
    d = copy.deepcopy(a)
    torch_opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    torch_opt.load_state_dict(converted)
    for saved, st in zip(opt_c.state.values(), torch_opt.state.values(), strict=True):
        assert all(torch.equal(st[k], saved[k]) for k in ("exp_avg", "exp_avg_sq"))
    d(input_ids=ids, labels=ids).loss.backward()
    torch_opt.step()


def test_fp32_state_of_bf16_weights_resumes_bit_identical():
    """torch.optim's loading casts floating state to the weight's dtype: fp32 state of bf16 weights must come back
    from the checkpoint in fp32, not through bf16."""
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    a = tiny_model("llama").to(torch.bfloat16)
    opt_a = ForgeAdamW(a.parameters(), model=a, lr=1e-3, state_dtype=torch.float32)
    _train(a, opt_a, ids, 2)
    sd = copy.deepcopy(opt_a.state_dict())
    b = copy.deepcopy(a)
    _train(a, opt_a, ids, 2)
    opt_b = ForgeAdamW(b.parameters(), model=b, lr=1e-3, state_dtype=torch.float32)
    opt_b.load_state_dict(sd)
    assert all(st["exp_avg"].dtype == torch.float32 for st in opt_b.state.values())
    _train(b, opt_b, ids, 2)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    for o in (opt_a, opt_b):
        o.detach()
