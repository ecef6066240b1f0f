"""Triton twin of the chunked head's fused cross-entropy (:func:`memgrad_hf.kernels.head.fused_cross_entropy`).

Per chunk of tokens cuBLAS computes the logits ``u = x Wᵀ + b`` in the weight's dtype; then one Triton program per
row reads its row twice — an online max / sum-exp (and the mean logit, for label smoothing), then the gradient — and
writes ``dL/du`` over the logits in place, in the same dtype; cuBLAS forms ``dX`` and ``dW`` from it. Two reads
and one write of a low-precision row replace the torch path's ~10 fp32 passes (what made it 3-7x slower than Liger
and TRL on an H100, benchmarks/RESULTS.md). The epilogue (logit scale, softcap, temperature) is applied on the fly.

Only the fused cross-entropy runs here; the per-token statistics and recompute-in-backward schedules
(:func:`head_stats`, :func:`head_backward`, ...) are the torch path's, re-exported so that this module serves
:func:`memgrad_hf.kernels.head_impl` whole. Tested against the torch twin under ``TRITON_INTERPRET=1``
(``tests/_head_triton_check.py``); on a GPU it is opt-in (``MEMGRAD_BACKEND=triton``) until measured there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from memgrad_hf.kernels.head import (  # noqa: F401  (the torch path's other schedules, served as they are)
    Epilogue,
    Stats,
    _dw_buffer,
    _mm_f32,
    default_chunk_size,
    head_backward,
    head_backward_vocab_blocks,
    head_stats,
)

PREFERS_FUSED = True  # functional.linear_cross_entropy: gradients in the forward pass by default with this backend

@triton.jit
def _tanh(x):
    """tanh in fp32 to ~4e-7 relative, the same code compiled and interpreted (the interpreter has no libdevice
    tanh): a Taylor series below |x| = 0.1, where ``1 - exp(-2|x|)`` would cancel, the exp form above."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    r = tl.where(ax < 0.1, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -r, r)


@triton.jit
def _epilogue(u, inp, out, TANH: tl.constexpr):
    if TANH:
        return out * _tanh(u * inp)
    return u * inp


@triton.jit
def _ce_rows_kernel(
    u_ptr, s_u, t_ptr, w_ptr, loss_ptr,
    V, eps, zl, inp, out,
    TANH: tl.constexpr, SMOOTH: tl.constexpr, WANT_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = u_ptr + row * s_u
    t = tl.load(t_ptr + row)
    wt = tl.load(w_ptr + row)
    cols0 = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    zsum = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + cols0
        ok = cols < V
        z = _epilogue(tl.load(base + cols, mask=ok, other=0.0).to(tl.float32), inp, out, TANH)
        zm = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(zm, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(zm - m_new), 0)
        m = m_new
        if SMOOTH:
            zsum += tl.sum(tl.where(ok, z, 0.0), 0)
    zt = _epilogue(tl.load(base + t).to(tl.float32), inp, out, TANH)
    lse = m + tl.log(s)
    ce = lse - zt
    if SMOOTH:
        ce = (1.0 - eps) * ce + eps * (lse - zsum / V)
    ce = ce + zl * lse * lse
    tl.store(loss_ptr + row, wt * ce)
    if WANT_GRAD:
        # dL/dz_j = alpha p_j + gamma [j == t] + delta   (REFERENCE §2.2), then dz/du of the epilogue
        alpha = wt * (1.0 + 2.0 * zl * lse)
        gamma = -(1.0 - eps) * wt
        delta = -(eps / V) * wt
        for v0 in range(0, V, BLOCK):
            cols = v0 + cols0
            ok = cols < V
            u = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
            z = _epilogue(u, inp, out, TANH)
            g = alpha * tl.exp(z - lse) + delta + tl.where(cols == t, gamma, 0.0)
            if TANH:
                th = z / out
                g = g * (inp * out * (1.0 - th * th))
            else:
                g = g * inp
            tl.store(base + cols, g.to(u_ptr.dtype.element_ty), mask=ok)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, buf: Tensor) -> Tensor:
    out = buf[: h.shape[0]]
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def fused_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    ep: Epilogue,
    token_weight: Tensor,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_size: int,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    accum_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Same contract as the torch twin :func:`memgrad_hf.kernels.head.fused_cross_entropy`: ``Σ_i w_i · CE_i`` and
    ``(loss, dX, dW, db)``. The logits block and ``dL/du`` live in the weight's dtype (as ``nn.Linear``'s logits
    and autograd's logit gradient do); every row reduction is fp32."""
    n, vocab = hidden.shape[0], weight.shape[0]
    want_grad = need_dx or need_dw or need_db
    dx = torch.empty_like(hidden) if need_dx else None
    # an fp32 accumulator for low-precision weights is zeroed and summed into (tensor-core GEMMs with fp32 output)
    dw = None if not need_dw else (_dw_buffer(weight, n, accum_dtype) if accum_dtype == weight.dtype else
                                   torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device))
    db = torch.zeros(vocab, dtype=accum_dtype, device=weight.device) if need_db else None
    rows_loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    buf = torch.empty(min(n, chunk_size), vocab, dtype=weight.dtype, device=hidden.device)
    tw = token_weight.to(torch.float32).contiguous()
    block = min(4096, triton.next_power_of_2(vocab))
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        h = hidden[s:e]
        u = _logits(h, weight, bias, buf)
        _ce_rows_kernel[(e - s,)](
            u, u.stride(0), targets[s:e], tw[s:e], rows_loss[s:e],
            vocab, float(label_smoothing), float(z_loss), float(ep.inp), float(ep.out),
            TANH=ep.tanh, SMOOTH=label_smoothing > 0, WANT_GRAD=want_grad, BLOCK=block, num_warps=8,
        )
        if not want_grad:
            continue
        du = u  # overwritten in place by the kernel
        if dx is not None:
            torch.mm(du, weight, out=dx[s:e]) if dx.dtype == weight.dtype else dx[s:e].copy_(du @ weight)
        if dw is not None:
            if dw.dtype == weight.dtype:
                torch.mm(du.t(), h, out=dw) if s == 0 else dw.addmm_(du.t(), h)
            else:
                _mm_f32(du.t(), h, dw)
        if db is not None:
            db.add_(du.sum(0, dtype=db.dtype))
    return rows_loss.sum(), dx, dw, db
