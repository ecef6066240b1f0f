"""The manual inner-gradient kernel equals torch.func.vmap(grad) (first and second order)."""

import pytest
import torch

from memgrad_hf.kernels import titans as K
from tests.helpers import rel_err


def _inputs(depth: int, g=6, c=16, d=8, e=4, shared=False, dtype=torch.float32):
    widths = [d] + [d * e] * (depth - 1) + [d]
    lead = () if shared else (g,)
    ws = [(torch.randn(*lead, widths[i], widths[i + 1], dtype=dtype) / widths[i] ** 0.5).requires_grad_()
          for i in range(depth)]
    gamma = (0.1 * torch.randn(*lead, d, dtype=dtype)).requires_grad_()
    k, v, q = (torch.randn(g, c, d, dtype=dtype, requires_grad=True) for _ in range(3))
    lr = torch.rand(g, c, dtype=dtype, requires_grad=True)
    return ws, gamma, k, v, q, lr


def _run(step, ws, gamma, k, v, q, lr, activation):
    grads, dgamma, retrieved, token_loss = step(ws, gamma, k, v, lr, q, activation)
    gen = torch.Generator().manual_seed(1)
    probe = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in (*grads, dgamma, retrieved))
    outer = torch.autograd.grad(probe, [*ws, gamma, k, v, q, lr])
    return [*grads, dgamma, retrieved, token_loss, *outer]


@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_manual_equals_torch_func_fp32(depth, activation):
    args = _inputs(depth)
    manual = _run(K.memory_step, *args, activation)
    ref = _run(K.memory_step_autograd, *args, activation)
    first_order = len(args[0]) + 3
    for a, b in zip(manual[:first_order], ref[:first_order], strict=True):  # inner gradients, retrieval
        assert rel_err(a, b) < 1e-5
    # outer gradients: weights, gamma, keys, values, queries, lr
    for a, b in zip(manual[first_order + 1:], ref[first_order + 1:], strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_manual_equals_torch_func_fp64_and_shared_weights(activation):
    args = _inputs(2, shared=True, dtype=torch.float64)
    ref = _run(K.memory_step_autograd, *args, activation)
    for a, b in zip(_run(K.memory_step, *args, activation), ref, strict=True):
        assert rel_err(a, b) < 1e-12


def test_no_queries_and_grad_shapes():
    ws, gamma, k, v, _, lr = _inputs(3)
    grads, dgamma, retrieved, token_loss = K.memory_step(ws, gamma, k, v, lr, None, "gelu")
    assert retrieved is None and token_loss.shape == lr.shape
    assert [g.shape for g in grads] == [w.shape for w in ws] and dgamma.shape == gamma.shape


@pytest.mark.parametrize("grad", [False, True])
def test_without_the_token_loss_the_same_step(grad):
    # what the memory layer calls: no per-token loss (two ops a chunk fewer), everything else bit-identical
    args = _inputs(2)
    ws, gamma, k, v, q, lr = args
    with torch.set_grad_enabled(grad):
        full = K.memory_step(ws, gamma, k, v, lr, q, "gelu")
        lean = K.memory_step(ws, gamma, k, v, lr, q, "gelu", return_loss=False)
        ref = K.memory_step_autograd(ws, gamma, k, v, lr, q, "gelu", return_loss=False)
    assert lean[3] is None and ref[3] is None and full[3] is not None
    for a, b in zip([*full[0], full[1], full[2]], [*lean[0], lean[1], lean[2]], strict=True):
        assert torch.equal(a, b)
    if grad:  # the outer backward without the loss output: as with it
        outer = [torch.autograd.grad(sum(t.square().sum() for t in (*r[0], r[1], r[2])), [*ws, gamma, k, v, q, lr])
                 for r in (full, lean)]
        for a, b in zip(*outer, strict=True):
            assert torch.equal(a, b)


def test_manual_kernel_works_under_non_reentrant_checkpoint():
    from torch.utils.checkpoint import checkpoint

    ws, gamma, k, v, q, lr = _inputs(2)

    def f(k, v, q, lr):
        grads, dgamma, retrieved, _ = K.memory_step(ws, gamma, k, v, lr, q, "gelu")
        return sum(g.square().sum() for g in grads) + retrieved.square().sum()

    plain = torch.autograd.grad(f(k, v, q, lr), [k, v, q, lr, *ws])
    ckpt = torch.autograd.grad(checkpoint(f, k, v, q, lr, use_reentrant=False), [k, v, q, lr, *ws])
    for a, b in zip(plain, ckpt, strict=True):
        assert rel_err(a, b) < 1e-6



def test_autograd_reference_under_non_reentrant_checkpoint_names_the_fix():
    # torch.func cannot run under saved tensor hooks; its own error named neither the setting nor the way out
    from torch.utils.checkpoint import checkpoint

    ws, gamma, k, v, q, lr = _inputs(2)

    def f(k, v, q, lr):
        grads, _, retrieved, _ = K.memory_step_autograd(ws, gamma, k, v, lr, q, "gelu")
        return sum(g.square().sum() for g in grads) + retrieved.square().sum()

    with pytest.raises(RuntimeError, match='grad_impl="manual"'):
        checkpoint(f, k, v, q, lr, use_reentrant=False).backward()
