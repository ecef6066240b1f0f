"""Stochastic-rounding noise: a hash of (seed, element index), so results do not depend on tiling or device."""

import pytest
import torch

import memgrad_hf.kernels.forge as K


def _lowbias32_reference(v: int) -> int:
    """The published lowbias32 mixer, written out independently on Python ints."""
    v &= 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * 0x846CA68B) & 0xFFFFFFFF
    v ^= v >> 16
    return v


@pytest.mark.parametrize("bits", [16, 20])
@pytest.mark.parametrize("seed,offset", [(0, 0), (12345, 7), (2**31 - 5, 2**31 - 100)])
def test_hash_bits_is_lowbias32_of_the_element_index(bits, seed, offset):
    shape = (33, 65)
    got = K.hash_bits(seed, offset, shape, bits, "cpu").reshape(-1)
    assert got.dtype == torch.int32 and got.min() >= 0 and got.max() < 2**bits
    key = _lowbias32_reference(seed)
    for i in [0, 1, 2, 64, 65, 1000, shape[0] * shape[1] - 1]:
        assert int(got[i]) == _lowbias32_reference(key + offset + i) & ((1 << bits) - 1), i


def test_hash_bits_are_uniform_and_seeds_independent():
    a = K.hash_bits(1, 0, (1 << 20,), 16, "cpu")
    b = K.hash_bits(2, 0, (1 << 20,), 16, "cpu")
    for bit in range(16):
        assert abs(((a >> bit) & 1).float().mean().item() - 0.5) < 3e-3  # ~6 sigma at 2^20 samples
    counts = torch.bincount(a >> 12, minlength=16).float()  # top 4 of the 16 bits: 16 equally likely buckets
    chi2 = ((counts - counts.mean()) ** 2 / counts.mean()).sum().item()
    assert chi2 < 50  # 15 degrees of freedom: p < 1e-5 above this
    assert abs(torch.corrcoef(torch.stack([a.float(), b.float()]))[0, 1].item()) < 5e-3
    assert abs(torch.corrcoef(torch.stack([a[:-1].float(), a[1:].float()]))[0, 1].item()) < 5e-3


def _state(w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    st = {}
    for n in K.RULES["adamw"][1]:
        val = torch.rand(w.shape, generator=g) * 1e-3
        if dtype == K.Q_DTYPE:
            st[n], st[n + ".scale"] = K.quantize_8bit(val, positive=n == "exp_avg_sq")
        else:
            st[n] = val.to(dtype)
    return st


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, K.Q_DTYPE])
def test_rounded_updates_do_not_depend_on_tiles_or_row_blocks(monkeypatch, state_dtype):
    torch.manual_seed(0)
    w0 = torch.randn(96, 200).to(torch.bfloat16)
    dy, x = torch.randn(24, 96), torch.randn(24, 200)
    hp = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    results = []
    for rows_per_tile, sub_block_bytes in [(96, 1 << 20), (16, 1 << 20), (16, 1)]:  # 1 byte: one-row blocks
        monkeypatch.setattr(K, "SUB_BLOCK_BYTES", sub_block_bytes)
        w, st = w0.clone(), _state(w0, state_dtype)
        K.linear_weight_step("adamw", dy.bfloat16(), x.bfloat16(), w, st, hp, 3, rows_per_tile=rows_per_tile,
                             stochastic_rounding=True, seed=77)
        results.append((w, st))
    assert not torch.equal(results[0][0], w0)
    for w, st in results[1:]:
        assert torch.equal(w, results[0][0])
        for k, v in st.items():
            assert torch.equal(v.view(torch.uint8) if v.dtype == K.Q_DTYPE else v,
                               results[0][1][k].view(torch.uint8) if v.dtype == K.Q_DTYPE else results[0][1][k]), k
