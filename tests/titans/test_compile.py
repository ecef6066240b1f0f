"""The manual kernel compiles with torch.compile(fullgraph=True) and trains through it (outer backward)."""

import torch

from memgrad_hf.kernels import titans as K
from tests.helpers import rel_err


def _step(w0, w1, gamma, k, v, lr, q):
    grads, dgamma, retrieved, _ = K.memory_step([w0, w1], gamma, k, v, lr, q, "gelu")
    return grads[0], grads[1], dgamma, retrieved


def test_manual_kernel_compiles_fullgraph_and_backpropagates():
    g, c, d = 4, 16, 8
    ws = [torch.randn(d, 4 * d, requires_grad=True), torch.randn(4 * d, d, requires_grad=True)]
    gamma = torch.zeros(d, requires_grad=True)
    k, v, q = (torch.randn(g, c, d, requires_grad=True) for _ in range(3))
    lr = torch.rand(g, c, requires_grad=True)
    inputs = [*ws, gamma, k, v, lr, q]
    compiled = torch.compile(_step, fullgraph=True)(*inputs)
    eager = _step(*inputs)
    for a, b in zip(compiled, eager, strict=True):
        assert rel_err(a, b) < 1e-5
    grads_c = torch.autograd.grad(sum(o.square().sum() for o in compiled), inputs)
    grads_e = torch.autograd.grad(sum(o.square().sum() for o in eager), inputs)
    for a, b in zip(grads_c, grads_e, strict=True):
        assert rel_err(a, b) < 1e-5
