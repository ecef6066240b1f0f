"""Triton twin of the Titans step's row ops (:func:`memgrad_hf.kernels.titans.ln_loss_grad` and
:func:`~memgrad_hf.kernels.titans.ln_residual`), one launch each.

Why: on a GPU the torch manual step at the sizes Titans runs (a chunk of 64-128 tokens, heads of 64-128) is bound by
launches, not by work: ~20 ops in 0.3-0.6 ms for ~1 GFLOP on an H100 (benchmarks/RESULTS.md). Nine of them are the
row ops between the key path's last GEMM and its first gradient GEMM (LayerNorm, residual, loss gradient, ``dgamma``,
LayerNorm backward) and two the retrieval's LayerNorm and residual. Here each group is one kernel; the GEMMs stay
with cuBLAS's batched kernels, which beat one Triton program per memory (:mod:`titans_triton`) at ``D >= 128``.

``ln_loss_grad`` runs one program per memory (``dgamma`` sums the chunk's rows without atomics, so results are
deterministic), walking the chunk in blocks of rows; ``ln_residual`` one program per (memory, block of rows). A
LayerNorm row (the head width ``D``, up to 8192) is one ``next_pow2(D)`` register tile; any ``C``, ``D`` (masked),
any strides of the keys, values, queries, learning rates and ``gamma``. fp32 only, no autograd: the torch manual
step calls it where autograd does not trace (``memory_step`` without inputs that require grad, and the forward of
its ``autograd.Function``); the outer backward stays in torch. On CPU it runs under ``TRITON_INTERPRET=1`` (tests).
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
def _ln_rows(m_ptr, row, offs_d, mask, D, eps):
    """Load rows of ``m`` (contiguous, width D) and return ``(h, mean, rstd)`` of the affine-free LayerNorm."""
    m = tl.load(m_ptr + row[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    mean = tl.sum(m, axis=1) / D
    xc = tl.where(mask, m - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    return xc * rstd[:, None], mean, rstd


@triton.jit
def _ln_loss_grad_kernel(m_ptr, k_ptr, v_ptr, lr_ptr, gamma_ptr, dm_ptr, dgamma_ptr, loss_ptr, h_ptr, mean_ptr,
                         rstd_ptr, diff_ptr, C, D, s_kg, s_kc, s_kd, s_vg, s_vc, s_vd, s_lg, s_lc, s_gg, s_gd, eps,
                         SAVE: tl.constexpr, LOSS: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    g = tl.program_id(0)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < D
    g1 = tl.load(gamma_ptr + g * s_gg + offs_d * s_gd, mask=dmask, other=0.0) + 1.0
    dgamma = tl.zeros([BD], dtype=tl.float32)
    for c0 in range(0, C, BC):
        offs_c = c0 + tl.arange(0, BC)
        cmask = offs_c < C
        mask = cmask[:, None] & dmask[None, :]
        row = g * C + offs_c  # m and every output are contiguous (G, C, ...)
        h, mean, rstd = _ln_rows(m_ptr, row, offs_d, mask, D, eps)
        k = tl.load(k_ptr + g * s_kg + offs_c[:, None] * s_kc + offs_d[None, :] * s_kd, mask=mask, other=0.0)
        v = tl.load(v_ptr + g * s_vg + offs_c[:, None] * s_vc + offs_d[None, :] * s_vd, mask=mask, other=0.0)
        diff = (k - v) + h * g1[None, :]  # M(k) - v; zero in masked columns
        lr = tl.load(lr_ptr + g * s_lg + offs_c * s_lc, mask=cmask, other=0.0)
        dy = diff * (lr * (2.0 / D))[:, None]
        dgamma += tl.sum(dy * h, axis=0)
        u = dy * g1[None, :]  # the LayerNorm output's gradient; its input gradient, from the forward's statistics:
        mu = tl.sum(u, axis=1) / D
        muh = tl.sum(u * h, axis=1) / D
        dm = rstd[:, None] * (u - mu[:, None] - h * muh[:, None])
        out = row[:, None] * D + offs_d[None, :]
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
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_d = tl.arange(0, BD)
    cmask, dmask = offs_c < C, offs_d < D
    mask = cmask[:, None] & dmask[None, :]
    row = g * C + offs_c
    h, mean, rstd = _ln_rows(m_ptr, row, offs_d, mask, D, eps)
    g1 = tl.load(gamma_ptr + g * s_gg + offs_d * s_gd, mask=dmask, other=0.0) + 1.0
    x = tl.load(x_ptr + g * s_xg + offs_c[:, None] * s_xc + offs_d[None, :] * s_xd, mask=mask, other=0.0)
    out = row[:, None] * D + offs_d[None, :]
    tl.store(out_ptr + out, x + h * g1[None, :], mask=mask)
    if SAVE:
        tl.store(h_ptr + out, h, mask=mask)
        tl.store(mean_ptr + row, mean, mask=cmask)
        tl.store(rstd_ptr + row, rstd, mask=cmask)


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
