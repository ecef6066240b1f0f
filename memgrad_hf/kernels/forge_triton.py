"""Triton twin of :func:`memgrad_hf.kernels.forge.linear_weight_step`: each program computes one ``dW`` tile in
registers (``Σ_k dYᵀ·X`` over all tokens, fp32 accumulation) and applies AdamW or Lion to that tile of the weight and
its state in the epilogue. ``dW`` is never written to memory. The caller computes ``dX`` first (old weights).

fp32 activations take IEEE fp32 dots (what torch's fp32 GEMM computes, TF32 off); bf16/fp16 activations go to the
tensor cores as they are, with fp32 accumulation: the exact products of the rounded operands, as cuBLAS computes the
weight gradient of a bf16 ``nn.Linear``.

Tested against the torch twin under ``TRITON_INTERPRET=1``; on a GPU it is selected by
:func:`memgrad_hf.kernels.backend`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest bf16 (ties to even), returned as fp32: bit arithmetic, so compiled and interpreted agree."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _forge_linear_kernel(
    dy_ptr, x_ptr, w_ptr, m_ptr, v_ptr, acc_ptr, norm_ptr, bad_ptr,
    N, OUT, IN,
    s_dyn, s_dyo, s_xn, s_xi, s_wo, s_wi,
    lr, beta1, beta2, eps, wd, bc1, bc2_sqrt,
    HAS_ACC: tl.constexpr, IS_LION: tl.constexpr, LOWP: tl.constexpr, IS_BF16: tl.constexpr, W_BF16: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < OUT
    cmask = cols < IN
    g = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, N, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < N
        dyt = tl.load(dy_ptr + ks[None, :] * s_dyn + rows[:, None] * s_dyo,
                      mask=rmask[:, None] & kmask[None, :], other=0.0)  # [BM, BK] = dYᵀ
        xt = tl.load(x_ptr + ks[:, None] * s_xn + cols[None, :] * s_xi,
                     mask=kmask[:, None] & cmask[None, :], other=0.0)  # [BK, BN]
        if TENSOR_CORES:
            g = tl.dot(dyt, xt, g)
        else:
            g = tl.dot(dyt.to(tl.float32), xt.to(tl.float32), g, input_precision="ieee")
    # The gradient a bf16/fp16 linear layer gets from autograd is rounded to its dtype (the twin's too). bf16:
    # round-to-nearest-even on the bits (the interpreter's cast truncates; this is the same compiled or not).
    if LOWP and IS_BF16:
        g = _round_bf16(g)
    elif LOWP:
        g = g.to(dy_ptr.dtype.element_ty).to(tl.float32)
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * s_wo + cols[None, :] * s_wi
    if HAS_ACC:
        g += tl.load(acc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(norm_ptr, tl.sum(tl.sum(g * g, axis=1), axis=0))
    nonfinite = mask & ((g != g) | (tl.abs(g) == float("inf")))
    finite = tl.sum(tl.sum(nonfinite.to(tl.int32), axis=1), axis=0) == 0
    if finite:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        w = w * (1.0 - lr * wd)
        if IS_LION:
            c = m + (g - m) * (1.0 - beta1)
            u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
            w = w - lr * u
            m = m + (g - m) * (1.0 - beta2)
        else:
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
            m = m + (g - m) * (1.0 - beta1)  # lerp, as torch's lerp_ (an FMA on CPU)
            v = v * beta2 + (1.0 - beta2) * g * g
            denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
            w = w + tl.div_rn(-(lr / bc1) * m, denom)
            tl.store(v_ptr + offs, v, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        if W_BF16:
            w = _round_bf16(w)
        tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(bad_ptr, 1)


def linear_weight_step(
    rule: str,
    dy: Tensor,
    x: Tensor,
    w: Tensor,
    st: dict[str, Tensor],
    hp: dict[str, Any],
    step: int,
    acc: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """Same contract as the torch twin: update ``w`` and ``st`` in place from ``dW = dyᵀx (+ acc)``; returns
    ``(Σ dW², number of tiles skipped for non-finite values)`` as device tensors. fp32 state only."""
    if rule not in ("adamw", "lion"):
        raise ValueError(f"no Triton FORGE kernel for rule {rule!r}")
    n, out_f = dy.shape
    in_f = x.shape[1]
    lr, (b1, b2), wd = hp["lr"], hp["betas"], hp["weight_decay"]
    eps = hp.get("eps", 0.0)
    m = st["exp_avg"]
    v = st.get("exp_avg_sq", m)
    if m.dtype != torch.float32 or v.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError("the Triton FORGE kernel takes contiguous weights and fp32 optimizer state")
    norm = torch.zeros((), dtype=torch.float32, device=w.device)
    bad = torch.zeros((), dtype=torch.int32, device=w.device)
    lowp = dy.dtype in (torch.bfloat16, torch.float16) and x.dtype == dy.dtype
    # 64x64 tiles: a few thousand programs for an LLM's projections, and the epilogue's weight + state tiles
    # stay in registers; K steps of 64 for tensor-core dots, 32 for the register-heavier fp32 ones.
    bm, bn, bk = 64, 64, 64 if lowp else 32
    grid = (triton.cdiv(out_f, bm), triton.cdiv(in_f, bn))
    _forge_linear_kernel[grid](
        dy, x, w, m, v, acc if acc is not None else w, norm, bad,
        n, out_f, in_f,
        dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        float(lr), float(b1), float(b2), float(eps), float(wd), float(1 - b1**step), float((1 - b2**step) ** 0.5),
        HAS_ACC=acc is not None, IS_LION=rule == "lion", LOWP=lowp, IS_BF16=dy.dtype == torch.bfloat16,
        W_BF16=w.dtype == torch.bfloat16, BM=bm, BN=bn, BK=bk,
        # the interpreter's dot misreads bf16 operands; upcast there (exact products, the same fp32 sums)
        TENSOR_CORES=lowp and os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=4, num_stages=3,
    )
    return norm, bad
