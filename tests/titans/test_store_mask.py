"""NeuralMemory's store mask: padding never reaches the memory, other tokens' outputs or the carried state."""

import pytest
import torch

from memgrad_hf.titans import NeuralMemory


def _mem(**kw):
    torch.manual_seed(0)
    return NeuralMemory(16, heads=2, chunk_size=4, max_lr=0.5, **kw).double()


def _mask(b, t, zeros):
    m = torch.ones(b, t)
    for i, js in enumerate(zeros):
        m[i, js] = 0
    return m


@pytest.mark.parametrize("momentum,forget", [(True, True), (False, False)])
def test_masked_tokens_do_not_leak(momentum, forget):
    mem = _mem(momentum=momentum, forget=forget)
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    # left padding (5 tokens: a whole chunk and one more), a gap mid-sequence, a pad at the end
    mask = _mask(2, 13, [list(range(5)), [6, 7, 12]])
    noisy = torch.where(mask[..., None].bool(), x, x + 10 * torch.randn_like(x))
    with torch.no_grad():
        y, st = mem(x, mask=mask)
        y2, st2 = mem(noisy, mask=mask)
        keep = mask.bool()
        assert torch.equal(y[keep], y2[keep])
        for a, b in zip((*st.weights, st.gamma, *(st.momentum or ())), (*st2.weights, st2.gamma,
                                                                         *(st2.momentum or ())), strict=True):
            assert torch.equal(a, b)
        # what is still pending (the masked pad at the end) must not leak into the next segment either
        z = torch.randn(2, 6, 16, dtype=torch.float64)
        assert torch.equal(mem(z, st)[0], mem(z, st2)[0])
        # and the mask matters: without it the pads do leak
        assert not torch.allclose(mem(x)[0][keep], mem(noisy)[0][keep])


def test_chunk_aligned_left_padding_equals_the_unpadded_sequence():
    mem = _mem()
    real = torch.randn(1, 9, 16, dtype=torch.float64)
    padded = torch.cat([torch.randn(1, 8, 16, dtype=torch.float64), real], 1)  # two whole chunks of padding
    mask = _mask(1, 17, [list(range(8))])
    with torch.no_grad():
        y_pad, st_pad = mem(padded, mask=mask)
        y, st = mem(real)
    torch.testing.assert_close(y_pad[:, 8:], y, rtol=1e-12, atol=1e-12)
    for a, b in zip((*st_pad.weights, st_pad.gamma), (*st.weights, st.gamma), strict=True):
        torch.testing.assert_close(a.expand_as(b) if a.dim() < b.dim() else a, b, rtol=1e-12, atol=1e-12)


def test_masked_segments_equal_one_call_and_later_segments_may_omit_the_mask():
    mem = _mem()
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    mask = _mask(2, 19, [list(range(3)), [5]])
    mask[:, 9:] = 1  # the second part has no padding: it may come without a mask
    with torch.no_grad():
        full, full_st = mem(x, mask=mask)
        a, st = mem(x[:, :6], mask=mask[:, :6])
        b, st = mem(x[:, 6:9], st, mask=mask[:, 6:9])
        c, st = mem(x[:, 9:], st)
    torch.testing.assert_close(torch.cat([a, b, c], 1), full, rtol=1e-12, atol=1e-12)
    assert st.seq_index == full_st.seq_index == 19


def test_all_ones_mask_equals_no_mask_and_gradients_flow():
    mem = _mem()
    x = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=True)
    y_mask, _ = mem(x, mask=torch.ones(2, 10))
    y, _ = mem(x)
    torch.testing.assert_close(y_mask, y, rtol=1e-12, atol=1e-12)
    mask = _mask(2, 10, [[0, 1], []])
    mem(x, mask=mask)[0].sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad[1].abs().sum() > 0
    assert all(torch.isfinite(mem.get_parameter(n).grad).all() for n in ("to_keys.weight", "to_gates.weight"))


def test_bad_mask_shape_is_refused():
    mem = _mem()
    with pytest.raises(ValueError, match="mask must have shape"):
        mem(torch.randn(2, 5, 16, dtype=torch.float64), mask=torch.ones(2, 4))
