"""Triton twin of the Titans step's row ops (:func:`memgrad_hf.kernels.titans.ln_loss_grad`,
:func:`~memgrad_hf.kernels.titans.ln_residual` and their backwards :func:`~memgrad_hf.kernels.titans.ln_loss_backward`,
:func:`~memgrad_hf.kernels.titans.ln_residual_backward`), one launch each.

Why: on a GPU the torch manual step at the sizes Titans runs (a chunk of 64-128 tokens, heads of 64-128) is bound by
launches, not by work: ~20 ops in 0.3-0.6 ms for ~1 GFLOP on an H100 (benchmarks/RESULTS.md). Nine of them are the
row ops between the key path's last GEMM and its first gradient GEMM (LayerNorm, residual, loss gradient, ``dgamma``,
LayerNorm backward) and two the retrieval's LayerNorm and residual; in the outer backward, ~35 ops go through the
LayerNorm/loss rows (the second-order terms) and four through the retrieval's. Here each group is one kernel; the
GEMMs stay with cuBLAS's batched kernels, which beat one Triton program per memory (:mod:`titans_triton`) at
``D >= 128``.

``ln_loss_grad`` and the backwards run one program per memory (``dgamma`` and ``gamma``'s gradient sum the chunk's
rows without atomics, so results are deterministic), walking the chunk in blocks of rows; ``ln_residual`` one program
per (memory, block of rows). A LayerNorm row (the head width ``D``, up to 8192) is one ``next_pow2(D)`` register
tile; any ``C``, ``D`` (masked), any strides of the keys, values, queries, learning rates, ``gamma`` and incoming
gradients. fp32 only, no autograd: the torch manual step calls them where autograd does not trace (``memory_step``
without inputs that require grad, the forward of its ``autograd.Function``, and its backward unless that is itself
differentiated). On CPU they run under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from memgrad_hf.kernels.titans import LN_EPS

MAX_HEAD_DIM = 8192
_TILE = 4096  # elements of a (rows x D) register tile


@triton.jit
def _ln_rows(m_ptr, out, mask, D, eps):
    """Load rows of ``m`` (contiguous, width D; ``out``: their element offsets) and return ``(h, mean, rstd)`` of the
    affine-free LayerNorm."""
    m = tl.load(m_ptr + out, mask=mask, other=0.0)
    mean = tl.sum(m, axis=1) / D
    xc = tl.where(mask, m - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    return xc * rstd[:, None], mean, rstd


@triton.jit
def _ln_input_grad(x, h, rstd, mask, D):
    """The affine-free LayerNorm's input gradient for an output gradient ``x`` (rows), from the forward's ``h`` and
    ``rstd``; zero in masked columns."""
    mu = tl.sum(x, axis=1) / D
    muh = tl.sum(x * h, axis=1) / D
    return tl.where(mask, rstd[:, None] * (x - mu[:, None] - h * muh[:, None]), 0.0)


@triton.jit
def _row_block(g, c0, C, D, offs_d, dmask, BC: tl.constexpr):
    """Rows ``c0 .. c0 + BC`` of memory ``g``: ``(offs_c, row mask, tile mask, flat row index, flat element
    offsets)``, the last two into contiguous ``(G, C)`` / ``(G, C, D)`` tensors."""
    offs_c = c0 + tl.arange(0, BC)
    cmask = offs_c < C
    row = g * C + offs_c
    return offs_c, cmask, cmask[:, None] & dmask[None, :], row, row[:, None] * D + offs_d[None, :]


@triton.jit
def _load_tile(ptr, g, offs_c, offs_d, s_g, s_c, s_d, mask):
    """A ``[rows, D]`` tile of a strided ``(G, C, D)`` tensor (zeros where masked)."""
    return tl.load(ptr + g * s_g + offs_c[:, None] * s_c + offs_d[None, :] * s_d, mask=mask, other=0.0)


@triton.jit
def _gain(gamma_ptr, g, s_gg, s_gd, offs_d, dmask):
    """``gamma + 1`` for memory ``g``, zero in masked columns."""
    return tl.where(dmask, tl.load(gamma_ptr + g * s_gg + offs_d * s_gd, mask=dmask, other=0.0) + 1.0, 0.0)


@triton.jit
def _ln_loss_grad_kernel(m_ptr, k_ptr, v_ptr, lr_ptr, gamma_ptr, dm_ptr, dgamma_ptr, loss_ptr, h_ptr, mean_ptr,
                         rstd_ptr, diff_ptr, C, D, s_kg, s_kc, s_kd, s_vg, s_vc, s_vd, s_lg, s_lc, s_gg, s_gd, eps,
                         SAVE: tl.constexpr, LOSS: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    g = tl.program_id(0)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < D
    g1 = _gain(gamma_ptr, g, s_gg, s_gd, offs_d, dmask)
    dgamma = tl.zeros([BD], dtype=tl.float32)
    for c0 in range(0, C, BC):
        offs_c, cmask, mask, row, out = _row_block(g, c0, C, D, offs_d, dmask, BC)  # m, outputs: contiguous
        h, mean, rstd = _ln_rows(m_ptr, out, mask, D, eps)
        k = _load_tile(k_ptr, g, offs_c, offs_d, s_kg, s_kc, s_kd, mask)
        v = _load_tile(v_ptr, g, offs_c, offs_d, s_vg, s_vc, s_vd, mask)
        diff = (k - v) + h * g1[None, :]  # M(k) - v; zero in masked columns
        lr = tl.load(lr_ptr + g * s_lg + offs_c * s_lc, mask=cmask, other=0.0)
        dy = diff * (lr * (2.0 / D))[:, None]
        dgamma += tl.sum(dy * h, axis=0)
        dm = _ln_input_grad(dy * g1[None, :], h, rstd, mask, D)
        tl.store(dm_ptr + out, dm, mask=mask)
        if LOSS:
            tl.store(loss_ptr + row, tl.sum(diff * diff, axis=1) / D, mask=cmask)
        if SAVE:
            tl.store(h_ptr + out, h, mask=mask)
            tl.store(diff_ptr + out, diff, mask=mask)
            tl.store(mean_ptr + row, mean, mask=cmask)
            tl.store(rstd_ptr + row, rstd, mask=cmask)
    tl.store(dgamma_ptr + g * D + offs_d, dgamma, mask=dmask)


@triton.jit
def _ln_residual_kernel(m_ptr, x_ptr, gamma_ptr, out_ptr, h_ptr, mean_ptr, rstd_ptr, C, D, s_xg, s_xc, s_xd, s_gg,
                        s_gd, eps, SAVE: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    g = tl.program_id(0)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < D
    offs_c, cmask, mask, row, out = _row_block(g, tl.program_id(1) * BC, C, D, offs_d, dmask, BC)
    h, mean, rstd = _ln_rows(m_ptr, out, mask, D, eps)
    g1 = _gain(gamma_ptr, g, s_gg, s_gd, offs_d, dmask)
    x = _load_tile(x_ptr, g, offs_c, offs_d, s_xg, s_xc, s_xd, mask)
    tl.store(out_ptr + out, x + h * g1[None, :], mask=mask)
    if SAVE:
        tl.store(h_ptr + out, h, mask=mask)
        tl.store(mean_ptr + row, mean, mask=cmask)
        tl.store(rstd_ptr + row, rstd, mask=cmask)


@triton.jit
def _ln_residual_backward_kernel(r_ptr, h_ptr, rstd_ptr, gamma_ptr, mbar_ptr, g1bar_ptr, C, D, s_rg, s_rc, s_rd, s_gg,
                                 s_gd, BC: tl.constexpr, BD: tl.constexpr):
    g = tl.program_id(0)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < D
    g1 = _gain(gamma_ptr, g, s_gg, s_gd, offs_d, dmask)
    g1bar = tl.zeros([BD], dtype=tl.float32)
    for c0 in range(0, C, BC):
        offs_c, cmask, mask, row, out = _row_block(g, c0, C, D, offs_d, dmask, BC)
        r = _load_tile(r_ptr, g, offs_c, offs_d, s_rg, s_rc, s_rd, mask)
        h = tl.load(h_ptr + out, mask=mask, other=0.0)
        rstd = tl.load(rstd_ptr + row, mask=cmask, other=0.0)
        tl.store(mbar_ptr + out, _ln_input_grad(r * g1[None, :], h, rstd, mask, D), mask=mask)
        g1bar += tl.sum(r * h, axis=0)
    tl.store(g1bar_ptr + g * D + offs_d, g1bar, mask=dmask)


@triton.jit
def _ln_loss_backward_kernel(w_ptr, h_ptr, rstd_ptr, diff_ptr, lr_ptr, gamma_ptr, rg_ptr, rl_ptr, mbar_ptr, xbar_ptr,
                             vbar_ptr, lrbar_ptr, g1bar_ptr, C, D, s_lg, s_lc, s_gg, s_gd, s_rgg, s_rgd, s_rlg, s_rlc,
                             HAS_W: tl.constexpr, HAS_RG: tl.constexpr, HAS_RL: tl.constexpr,
                             HAS_DYBAR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """The row ops of :func:`memgrad_hf.kernels.titans.ln_loss_backward` (same names; launched only when at least
    one incoming gradient is there, so ``diff_bar``, ``m_bar`` and ``g1_bar`` always are)."""
    g = tl.program_id(0)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < D
    g1 = _gain(gamma_ptr, g, s_gg, s_gd, offs_d, dmask)
    if HAS_RG:
        rg = tl.load(rg_ptr + g * s_rgg + offs_d * s_rgd, mask=dmask, other=0.0)
    g1bar = tl.zeros([BD], dtype=tl.float32)
    for c0 in range(0, C, BC):
        offs_c, cmask, mask, row, out = _row_block(g, c0, C, D, offs_d, dmask, BC)
        h = tl.load(h_ptr + out, mask=mask, other=0.0)
        rstd = tl.load(rstd_ptr + row, mask=cmask, other=0.0)
        diff = tl.load(diff_ptr + out, mask=mask, other=0.0)
        s = tl.load(lr_ptr + g * s_lg + offs_c * s_lc, mask=cmask, other=0.0) * (2.0 / D)
        dy = diff * s[:, None]
        mbar = tl.zeros([BC, BD], dtype=tl.float32)
        dybar = tl.zeros([BC, BD], dtype=tl.float32)
        hbar = tl.zeros([BC, BD], dtype=tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + out, mask=mask, other=0.0)
            u = dy * g1[None, :]
            dygbar = _ln_input_grad(w, h, rstd, mask, D)
            dybar = dygbar * g1[None, :]
            sw, su = tl.sum(w, axis=1), tl.sum(u, axis=1)
            wu, wh, uh = tl.sum(w * u, axis=1), tl.sum(w * h, axis=1), tl.sum(u * h, axis=1)
            coef_h = su * sw / D + 3.0 * wh * uh / D - wu
            mbar = (rstd * rstd / D)[:, None] * (((wh * su + uh * sw) / D)[:, None] - wh[:, None] * u
                                                 - uh[:, None] * w + h * coef_h[:, None])
        if HAS_RG:
            dybar += rg[None, :] * h
            hbar = rg[None, :] * dy
        diffbar = tl.zeros([BC, BD], dtype=tl.float32)
        if HAS_DYBAR:
            diffbar = dybar * s[:, None]
            tl.store(lrbar_ptr + row, tl.sum(dybar * diff, axis=1) * (2.0 / D), mask=cmask)
        if HAS_RL:
            rl = tl.load(rl_ptr + g * s_rlg + offs_c * s_rlc, mask=cmask, other=0.0)
            diffbar += diff * (rl * (2.0 / D))[:, None]
        hbar += diffbar * g1[None, :]
        if HAS_W:
            g1bar += tl.sum(diffbar * h + dygbar * dy, axis=0)
        else:
            g1bar += tl.sum(diffbar * h, axis=0)
        tl.store(xbar_ptr + out, diffbar, mask=mask)
        tl.store(vbar_ptr + out, -diffbar, mask=mask)
        tl.store(mbar_ptr + out, mbar + _ln_input_grad(hbar, h, rstd, mask, D), mask=mask)
    tl.store(g1bar_ptr + g * D + offs_d, g1bar, mask=dmask)


def _tiles(C: int, D: int) -> tuple[int, int]:
    if D > MAX_HEAD_DIM:
        raise ValueError(f"the Titans row kernels take a head width D <= {MAX_HEAD_DIM}, got D={D}; use "
                         "MEMGRAD_BACKEND=torch.")
    BD = triton.next_power_of_2(D)
    return max(1, min(triton.next_power_of_2(C), _TILE // BD)), BD


def _gamma_strides(gamma: Tensor) -> tuple[int, int]:
    return (0, gamma.stride(0)) if gamma.dim() == 1 else (gamma.stride(0), gamma.stride(1))


def _check(*ts: Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float32:
            raise ValueError(f"the Titans row kernels take fp32 tensors, got {t.dtype}; the memory step runs in fp32.")


def ln_loss_grad(m: Tensor, keys: Tensor, values: Tensor, lr: Tensor, gamma: Tensor, save: bool = False,
                 return_loss: bool = False) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, ...] | None]:
    """Same as :func:`memgrad_hf.kernels.titans.ln_loss_grad`, in one launch (no autograd)."""
    _check(m, keys, values, lr, gamma)
    m = m.contiguous()
    G, C, D = m.shape
    BC, BD = _tiles(C, D)
    dm, dgamma = torch.empty_like(m), m.new_empty(G, D)
    loss = m.new_empty(G, C) if return_loss else None
    h, diff = (torch.empty_like(m), torch.empty_like(m)) if save else (None, None)
    mean, rstd = (m.new_empty(G, C, 1), m.new_empty(G, C, 1)) if save else (None, None)
    unused = dm  # a pointer for the outputs a constexpr flag switches off
    _ln_loss_grad_kernel[(G,)](
        m, keys, values, lr, gamma, dm, dgamma, *(unused if t is None else t for t in (loss, h, mean, rstd, diff)),
        C, D, *keys.stride(), *values.stride(), *lr.stride(), *_gamma_strides(gamma), LN_EPS,
        SAVE=save, LOSS=return_loss, BC=BC, BD=BD, num_warps=4)
    return dm, dgamma, loss, ((h, mean, rstd, diff) if save else None)


def ln_residual(m: Tensor, x: Tensor, gamma: Tensor, save: bool = False) -> tuple[Tensor, tuple[Tensor, ...] | None]:
    """Same as :func:`memgrad_hf.kernels.titans.ln_residual`, in one launch (no autograd)."""
    _check(m, x, gamma)
    m = m.contiguous()
    G, C, D = m.shape
    BC, BD = _tiles(C, D)
    out = torch.empty_like(m)
    h, mean, rstd = (torch.empty_like(m), m.new_empty(G, C, 1), m.new_empty(G, C, 1)) if save else (out,) * 3
    _ln_residual_kernel[(G, triton.cdiv(C, BC))](m, x, gamma, out, h, mean, rstd, C, D, *x.stride(),
                                                 *_gamma_strides(gamma), LN_EPS, SAVE=save, BC=BC, BD=BD, num_warps=4)
    return out, ((h, mean, rstd) if save else None)


def ln_residual_backward(r: Tensor, m: Tensor, h: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor,
                         ) -> tuple[Tensor, Tensor]:
    """Same as :func:`memgrad_hf.kernels.titans.ln_residual_backward`, in one launch (no autograd)."""
    _check(r, h, rstd, gamma)
    h, rstd = h.contiguous(), rstd.contiguous()
    G, C, D = h.shape
    BC, BD = _tiles(C, D)
    mbar, g1bar = torch.empty_like(h), h.new_empty(G, D)
    _ln_residual_backward_kernel[(G,)](r, h, rstd, gamma, mbar, g1bar, C, D, *r.stride(), *_gamma_strides(gamma),
                                       BC=BC, BD=BD, num_warps=4)
    return mbar, g1bar


def ln_loss_backward(w: Tensor | None, m: Tensor, h: Tensor, mean: Tensor, rstd: Tensor, diff: Tensor, lr: Tensor,
                     gamma: Tensor, r_gamma: Tensor | None, r_loss: Tensor | None, differentiable: bool = False,
                     ) -> tuple[Tensor | None, ...]:
    """Same as :func:`memgrad_hf.kernels.titans.ln_loss_backward`, in one launch (no autograd: ``differentiable``
    is refused)."""
    if differentiable:
        raise ValueError("the Titans row kernels carry no graph: a differentiable backward takes the torch twin")
    if w is None and r_gamma is None and r_loss is None:
        return None, None, None, None, None
    present = [t for t in (w, r_gamma, r_loss) if t is not None]
    _check(h, rstd, diff, lr, gamma, *present)
    h, rstd, diff = h.contiguous(), rstd.contiguous(), diff.contiguous()
    w = None if w is None else w.contiguous()
    G, C, D = h.shape
    BC, BD = _tiles(C, D)
    mbar, xbar, vbar = torch.empty_like(h), torch.empty_like(h), torch.empty_like(h)
    g1bar = h.new_empty(G, D)
    has_dybar = w is not None or r_gamma is not None
    lrbar = h.new_empty(G, C) if has_dybar else None
    unused = h  # a pointer for what a constexpr flag switches off
    _ln_loss_backward_kernel[(G,)](
        *(unused if t is None else t for t in (w,)), h, rstd, diff, lr, gamma,
        *(unused if t is None else t for t in (r_gamma, r_loss)), mbar, xbar, vbar,
        unused if lrbar is None else lrbar, g1bar, C, D, *lr.stride(), *_gamma_strides(gamma),
        *((0, 0) if r_gamma is None else r_gamma.stride()), *((0, 0) if r_loss is None else r_loss.stride()),
        HAS_W=w is not None, HAS_RG=r_gamma is not None, HAS_RL=r_loss is not None, HAS_DYBAR=has_dybar,
        BC=BC, BD=BD, num_warps=4)
    return mbar, xbar, vbar, lrbar, g1bar
