"""Run under TRITON_INTERPRET=1 (by test_titans_triton.py): the Triton Titans memory step against its torch twin.

Forward outputs (weight gradients, dgamma, retrieval, token loss) for depths 1-4, GELU and SiLU, shared 2-D and
per-memory 3-D weights, with and without queries; then the autograd path once (Triton forward, torch-twin backward):
first-order outer gradients and a double backward. Then the row kernels (``titans_rows_triton``, what the torch step
uses on a GPU) against their twins, alone (masked sizes, strided inputs, every output flag) and inside the whole step,
inference and autograd (the saved row tensors feed the hand-written outer backward).
On a GPU machine: ``python tests/titans/_triton_twin_check.py cuda`` runs the compiled kernels instead. Prints one
line per config and exits non-zero above 1e-5 relative error.
"""

import contextlib
import sys

import torch

from memgrad_hf.kernels import titans as K
from memgrad_hf.kernels import titans_rows_triton as R
from memgrad_hf.kernels import titans_triton as T

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.abs().max().item()
    diff = (a - b).abs().max().item()
    if diff != diff:  # a NaN fails (max(worst, nan) would pass it over)
        return float("inf")
    return diff if denom == 0 else diff / denom


def make_inputs(depth: int, shared: bool, device: str, g: int = 2, c: int = 16, d: int = 16, e: int = 2,
                cq: int = 16, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    widths = [d] + [d * e] * (depth - 1) + [d]
    lead = () if shared else (g,)
    ws = [torch.randn(*lead, widths[i], widths[i + 1], generator=gen) / widths[i] ** 0.5 for i in range(depth)]
    gamma = 0.1 * torch.randn(*lead, d, generator=gen)
    k, v = torch.randn(g, c, d, generator=gen), torch.randn(g, c, d, generator=gen)
    q = torch.randn(g, cq, d, generator=gen)
    lr = torch.rand(g, c, generator=gen)
    move = lambda t: t.to(device)
    return [move(w) for w in ws], move(gamma), move(k), move(v), move(lr), move(q)


@contextlib.contextmanager
def torch_step():
    """The torch step with its torch row ops: on a GPU, K.memory_step would otherwise run an inference step at these
    widths as T's kernel (the twin checked against itself)."""
    rows_impl, K._rows_impl = K._rows_impl, lambda x: K
    try:
        yield
    finally:
        K._rows_impl = rows_impl


def check_forward(depth: int, activation: str, shared: bool, with_q: bool, device: str, **shape) -> float:
    ws, gamma, k, v, lr, q = make_inputs(depth, shared, device, **shape)
    q = q if with_q else None
    with torch.no_grad(), torch_step():
        ref = K.memory_step(ws, gamma, k, v, lr, q, activation)
    with torch.no_grad():
        out = T.memory_step(ws, gamma, k, v, lr, q, activation)
    assert (ref[2] is None) == (out[2] is None)
    with torch.no_grad():  # the layer's call: the same step, no per-token loss returned
        lean = T.memory_step(ws, gamma, k, v, lr, q, activation, return_loss=False)
    assert lean[3] is None and all(torch.equal(a, b) for a, b in zip(lean[0], out[0], strict=True))
    pairs = [*zip(ref[0], out[0], strict=True), (ref[1], out[1]), (ref[3], out[3])]
    if with_q:
        pairs.append((ref[2], out[2]))
    for a, b in pairs:
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return max(rel_err(b, a) for a, b in pairs)


def check_autograd(device: str) -> float:
    """Outer gradients (second order in the inner loss) and a double backward through the Triton step."""
    ws, gamma, k, v, lr, q = make_inputs(2, False, device, seed=3)
    leaves = [t.requires_grad_() for t in (*ws, gamma, k, v, lr, q)]
    gen = torch.Generator().manual_seed(5)
    probes = None
    results = []
    for step in (K.memory_step, T.memory_step):
        grads, dgamma, retrieved, token_loss = step(ws, gamma, k, v, lr, q, "silu")
        outs = (*grads, dgamma, retrieved, token_loss)
        if probes is None:
            probes = [torch.randn(o.shape, generator=gen).to(device) for o in outs]
        probe = sum((o * p).sum() for o, p in zip(outs, probes, strict=True))
        outer = torch.autograd.grad(probe, leaves, create_graph=True)
        second = torch.autograd.grad(sum(o.square().sum() for o in outer), leaves)
        results.append([*outer, *second])
    return max(rel_err(b, a) for a, b in zip(*results, strict=True))


def check_rows(device: str) -> float:
    gen = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device)
    worst = 0.0
    for G, C, D, shared, strided in [(3, 37, 48, False, False), (2, 16, 16, True, True), (1, 5, 300, True, True)]:
        m = rand(G, C, D) * 2 + 0.3
        k = rand(G, D, C).transpose(1, 2) if strided else rand(G, C, D)  # a projection's view, not contiguous
        v, q = rand(G, C, D), rand(G, D, C).transpose(1, 2)
        lr = torch.rand(G, C, generator=gen).to(device)
        gamma = 0.1 * (rand(D) if shared else rand(D, G).t())
        for save in (False, True):
            for loss in (False, True):
                a, b = K.ln_loss_grad(m, k, v, lr, gamma, save, loss), R.ln_loss_grad(m, k, v, lr, gamma, save, loss)
                assert (a[2] is None) == (b[2] is None) and (a[3] is None) == (b[3] is None)
                pairs = [(a[0], b[0]), (a[1], b[1]), *([(a[2], b[2])] if loss else [])]
                pairs += zip(a[3] or (), b[3] or (), strict=True)
                a, b = K.ln_residual(m, q, gamma, save), R.ln_residual(m, q, gamma, save)
                pairs += [(a[0], b[0]), *zip(a[1] or (), b[1] or (), strict=True)]
                for x, y in pairs:
                    assert x.shape == y.shape, (x.shape, y.shape)
                    worst = max(worst, rel_err(y, x))
        # the backward row kernels, for every combination of incoming gradients (dm, dgamma, token loss)
        _, _, _, (h, mean, rstd, diff) = K.ln_loss_grad(m, k, v, lr, gamma, save=True)
        w_in, rg_in, rl_in = rand(G, C, D), rand(D, G).t(), rand(C, G).t()  # strided incoming gradients
        for has_w in (False, True):
            for has_rg in (False, True):
                for has_rl in (False, True):
                    args = (w_in if has_w else None, m, h, mean, rstd, diff, lr, gamma, rg_in if has_rg else None,
                            rl_in if has_rl else None)
                    a, b = K.ln_loss_backward(*args), R.ln_loss_backward(*args)
                    for x, y in zip(a, b, strict=True):
                        assert (x is None) == (y is None), (has_w, has_rg, has_rl)
                        if x is not None:
                            assert x.shape == y.shape, (x.shape, y.shape)
                            worst = max(worst, rel_err(y, x))
        _, (hq, meanq, rstdq) = K.ln_residual(m, q, gamma, save=True)
        r_in = rand(G, D, C).transpose(1, 2)
        for x, y in zip(K.ln_residual_backward(r_in, m, hq, meanq, rstdq, gamma),
                        R.ln_residual_backward(r_in, m, hq, meanq, rstdq, gamma), strict=True):
            assert x.shape == y.shape
            worst = max(worst, rel_err(y, x))
    print(f"row kernels alone (forward and backward): rel err {worst:.2e}")
    ws, gamma, k, v, lr, q = make_inputs(3, False, device, g=3, c=40, d=12, e=3, cq=24, seed=11)
    with torch.no_grad():
        ref, _ = K._step_forward(ws, gamma, k, v, lr, q, "gelu", save=False)
        out, _ = K._step_forward(ws, gamma, k, v, lr, q, "gelu", save=False, rows=R)
    err = max(rel_err(b, a) for a, b in zip(ref, out, strict=True))
    print(f"step with row kernels, inference: rel err {err:.2e}")
    worst = max(worst, err)
    # what K.memory_step runs for an inference step where the row kernels run (a GPU; forced here): at head width
    # <= 64 the whole-step kernel, equal to the torch step; at 128 the torch step with the row kernels
    rows_impl, K._rows_impl = K._rows_impl, lambda x: R
    try:
        assert K._inference_step(ws, gamma, k, v, lr, q) is T.memory_step
        with torch.no_grad():
            out = K.memory_step(ws, gamma, k, v, lr, q, "gelu", return_loss=False)
        wide = make_inputs(2, True, device, g=2, c=8, d=128, e=1, cq=4, seed=5)
        assert K._inference_step(*wide) is None
    finally:
        K._rows_impl = rows_impl
    assert out[3] is None and out[2] is not None
    n = len(ws)  # ref: (*grads, dgamma, token_loss, retrieved)
    err = max(rel_err(b, a) for a, b in zip((*out[0], out[1], out[2]), (*ref[:n], ref[n], ref[n + 2]), strict=True))
    print(f"inference step as K.memory_step dispatches it (whole-step kernel): rel err {err:.2e}")
    worst = max(worst, err)
    leaves = [t.requires_grad_() for t in (*ws, gamma, k, v, lr, q)]
    rows_impl = K._rows_impl
    # the Function's forward and backward with the torch rows, then with the kernels; every output used, then the
    # layer's use (no token loss), then the retrieval alone (no gradient reaches the key path's row ops)
    for used in ((0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4), (4,)):
        results = []
        for impl in (rows_impl, lambda x: R):
            K._rows_impl = impl
            grads, dgamma, retrieved, token_loss = K.memory_step(ws, gamma, k, v, lr, q, "silu",
                                                                 return_loss=5 in used)
            outs = [o for i, o in enumerate((*grads, dgamma, retrieved, token_loss)) if i in used]
            probe = sum((o * torch.cos(torch.arange(o.numel(), device=device).view(o.shape) * 0.37)).sum()
                        for o in outs)
            results.append([*outs, *torch.autograd.grad(probe, leaves, allow_unused=True)])
        K._rows_impl = rows_impl
        err = max(rel_err(b, a) for a, b in zip(*results, strict=True) if a is not None)
        print(f"step with row kernels, autograd, outputs {used} (outputs + outer grads): rel err {err:.2e}")
        worst = max(worst, err)
    return worst


def main(device: str) -> int:
    worst = 0.0
    for depth in (1, 2, 3, 4):
        for activation in ("gelu", "silu"):
            for shared in (False, True):
                for with_q in (False, True):
                    err = check_forward(depth, activation, shared, with_q, device)
                    worst = max(worst, err)
                    print(f"depth={depth} {activation} {'shared' if shared else 'per-memory'} "
                          f"{'queries' if with_q else 'no-queries'}: rel err {err:.2e}")
    # non-power-of-two sizes (masks), more rows than one block, queries of another length
    err = check_forward(2, "gelu", False, True, device, g=3, c=40, d=12, e=3, cq=56)
    print(f"masked shapes G=3 C=40 D=12 H=36 Cq=56: rel err {err:.2e}")
    worst = max(worst, err)
    err = check_autograd(device)
    print(f"autograd (outer grads + double backward): rel err {err:.2e}")
    worst = max(worst, check_rows(device), err)
    print(f"max relative error {worst:.3e}")
    return 0 if worst < TOL else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
