"""8-bit optimizer state (block-wise scaled e4m3 codes): stated error bounds, unbiased rounding, checkpoints."""

import copy

import pytest
import torch

import memgrad_hf.optim.forge as forge_mod
from memgrad_hf.kernels.forge import Q_BLOCK, Q_DTYPE, dequantize_8bit, quantize_8bit, scale_shape
from memgrad_hf.optim import ForgeAdamW, ForgeLion
from tests.tiny_models import tiny_model


def _wide_range(rows: int = 8, cols: int = 200) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # magnitudes spread over 8 decades inside each block: the case linear int8 gets wrong
    return torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(-6, 2, (rows, cols), generator=g).float()


def test_quantize_round_trip_within_stated_bound():
    x = _wide_range()
    codes, scale = quantize_8bit(x)
    assert codes.dtype == Q_DTYPE and codes.shape == x.shape
    assert scale.shape == scale_shape(x.shape) == (8, -(-200 // Q_BLOCK))
    err = (dequantize_8bit(codes, scale) - x).abs()
    per_elem_scale = scale.repeat_interleave(Q_BLOCK, dim=-1)[:, :200]
    assert (err <= 2**-4 * x.abs() + 2**-10 * per_elem_scale + 1e-12).all()
    codes_sr, scale_sr = quantize_8bit(x, seed=3)
    err_sr = (dequantize_8bit(codes_sr, scale_sr) - x).abs()
    assert (err_sr <= 2**-3 * x.abs() + 2**-9 * per_elem_scale + 1e-12).all()
    # a linear int8 code would flush most of these to zero; e4m3 keeps every value above 2^-10 of its block's scale
    kept = x.abs() > 2**-9 * per_elem_scale
    assert (dequantize_8bit(codes, scale)[kept] != 0).all()


def test_stochastic_8bit_rounding_is_unbiased_and_keep_positive_floors():
    x = torch.full((1, 64 * 4000), 1.1)
    x[0, ::64] = 224.0 / 0.9  # block max: scale 1/0.9 maps 1.1 to 0.99, between e4m3 codes 0.9375 and 1.0
    codes, scale = quantize_8bit(x, seed=5)
    deq = dequantize_8bit(codes, scale)
    body = deq.reshape(-1, 64)[:, 1:]
    assert len(body.unique()) == 2
    assert abs(body.double().mean().item() - 1.1) < 1e-3  # ~5 sigma of the binomial noise
    near = dequantize_8bit(*quantize_8bit(x)).reshape(-1, 64)[:, 1:]
    assert abs(near.double().mean().item() - 1.1) > 5e-3  # nearest rounding is biased here
    tiny = torch.tensor([[1.0] + [1e-12] * 63])
    assert (dequantize_8bit(*quantize_8bit(tiny, keep_positive=True)) > 0).all()
    assert (dequantize_8bit(*quantize_8bit(tiny))[0, 1:] == 0).all()


@pytest.mark.parametrize("seed", [None, 7], ids=["nearest", "stochastic"])
def test_keep_positive_keeps_zeros_zero_in_every_implementation(seed):
    """sqrt(v) = 0 (no gradient yet) must stay 0: the smallest code of an all-zero block (scale 1) is 2^-9 in
    absolute terms, far above the sqrt(v) of the small gradients that come later, and would hold their updates
    back for thousands of steps. The eager path and the compiled CPU loop's quantizer alike."""
    from memgrad_hf.kernels import forge_compiled as C

    x = torch.tensor([[0.0] * 64, [1.0] + [0.0] * 31 + [1e-12] * 32])
    deq = dequantize_8bit(*quantize_8bit(x, seed, keep_positive=True))
    assert (deq[x == 0] == 0).all() and (deq[x > 0] > 0).all()
    key = None if seed is None else torch.tensor(seed, dtype=torch.int32)
    codes, scale = C._quantize(x, key, keep_positive=True)  # [blocks, Q_BLOCK] rows
    deq = codes.float() * scale[:, None]
    assert (deq[x == 0] == 0).all() and (deq[x > 0] > 0).all()


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
    2^-2·lr of the fp32-state step; after n steps every weight is within n·lr·2^-2 of the fp32-state run."""
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
