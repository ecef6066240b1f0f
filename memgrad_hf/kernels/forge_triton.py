"""Triton twins of :func:`memgrad_hf.kernels.forge.linear_weight_step` and :func:`memgrad_hf.kernels.forge.update_step`:
each program computes one ``dW`` tile in registers (``Σ_k dYᵀ·X`` over all tokens, fp32 accumulation) — or loads a
given gradient tile — and applies AdamW or Lion to that tile of the weight and its state (fp32, bf16 or block-scaled
8-bit; stochastic rounding with the twin's hashed noise) in the epilogue. ``dW`` is never written to memory. The
caller computes ``dX`` first (old weights).

fp32 activations take IEEE fp32 dots (what torch's fp32 GEMM computes, TF32 off); bf16/fp16 activations go to the
tensor cores as they are, with fp32 accumulation: the exact products of the rounded operands, as cuBLAS computes the
weight gradient of a bf16 ``nn.Linear``.

Tested against the torch twin under ``TRITON_INTERPRET=1``; on a GPU it is selected by
:func:`memgrad_hf.kernels.backend`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from memgrad_hf.kernels import forge as K
from memgrad_hf.kernels.triton_common import round_bf16 as _round_bf16
from memgrad_hf.kernels.triton_launch import Launcher

logger = logging.getLogger(__name__)

# State storage kinds (constexpr): fp32, bf16 (rounded to nearest; the second moment stochastically), 8-bit
# (block-scaled codes of state_codes, blocks of 64 along a row = one tile's row; the second moment kept as sqrt(v)).
F32, BF16, Q8 = 0, 1, 2

# Triton reads TRITON_INTERPRET when it decorates the kernels below (at import), so this module does too
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Launch configuration of the fused weight-gradient kernel, for bf16/fp16 activations (tensor cores) and fp32 ones
# (IEEE dots). ``bn`` (tile columns) is a multiple of 64: with 8-bit state a tile row spans whole scale blocks.
# Module-level so that benchmarks.forge_launch --sweep can time others. bf16, 2048x2048 weight, 1024 tokens, H100
# (2026-11-23): 128-row tiles on 8 warps took 77 µs per call where 64-row tiles on 4 warps took 145.
LINEAR_TILES = {
    "lowp": {"bm": 128, "bn": 64, "bk": 64, "num_warps": 8, "num_stages": 3},
    "fp32": {"bm": 64, "bn": 64, "bk": 32, "num_warps": 4, "num_stages": 3},
}


@triton.jit
def _hash_bits(key, idx, BITS: tl.constexpr):
    """The low ``BITS`` of lowbias32(key + idx) on uint32: :func:`memgrad_hf.kernels.forge.hash_bits`."""
    x = idx + key
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x & ((1 << BITS) - 1)


@triton.jit
def _round_stochastic(x, noise, DROP: tl.constexpr):
    """Add ``noise`` (< 2^DROP) to fp32 bits and clear the low ``DROP`` bits (the twin's ``_sr_truncate``)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + noise) & ((0xFFFFFFFF >> DROP) << DROP)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _code_decode(code, POSITIVE: tl.constexpr):
    """8-bit state code (uint8) -> fp32 before the block's scale, exactly: :func:`state_codes.decode` (e3m5 for a
    ``POSITIVE`` sqrt(v), else signed e3m4). The formats' constants written out per branch (M = 5 or 4 mantissa
    bits, E_MIN = -6): value = mantissa · 2^(max(binade, 1) - 1 + E_MIN - M)."""
    if POSITIVE:
        mag = code.to(tl.int32)
        f = mag >> 5
        q = mag & 31
        mant = tl.where(f > 0, q + 32, q)
        expo = tl.maximum(f, 1) + 115  # 126 + E_MIN - M, biased
    else:
        mag = code.to(tl.int32) & 0x7F
        f = mag >> 4
        q = mag & 15
        mant = tl.where(f > 0, q + 16, q)
        expo = tl.maximum(f, 1) + 116
    val = mant.to(tl.float32) * (expo << 23).to(tl.float32, bitcast=True)
    if not POSITIVE:
        val = tl.where(code.to(tl.int32) >= 0x80, -val, val)
    return val


@triton.jit
def _code_encode(y, noise, SR: tl.constexpr, POSITIVE: tl.constexpr):
    """fp32 ``y`` over its block's scale -> 8-bit state code: :func:`state_codes.encode`, with ``noise`` (int32,
    16 bits) when ``SR``, else to nearest (ties to even). Constants per branch as in :func:`_code_decode`."""
    if POSITIVE:
        a = tl.minimum(tl.abs(y), 1.96875)
        a = tl.where(a > 0, tl.maximum(a, 0.00048828125), a)  # no positive value becomes 0; zeros stay 0
        bexp = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)  # 127 + floor(log2 a), at least 127 + E_MIN
        t = a * ((259 - bexp) << 23).to(tl.float32, bitcast=True)  # times 2^(M - floor(log2 a)): exact
        base = (bexp - 121) << 5
    else:
        a = tl.minimum(tl.abs(y), 1.9375)
        bexp = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)
        t = a * ((258 - bexp) << 23).to(tl.float32, bitcast=True)
        base = (bexp - 121) << 4
    if SR:
        q = ((t * 65536.0).to(tl.int32) + noise) >> 16
    else:
        q = ((t + 8388608.0) - 8388608.0).to(tl.int32)  # rint, ties to even (fp32 addition rounds so)
    code = base + q
    if not POSITIVE:  # the sign bit of y (-0.0 included) as bit 7
        code = code | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
    return code.to(tl.uint8)


@triton.jit
def _per_block(s, BM: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr):
    """``[BM, BN // QB]`` per-block values spread over their ``QB`` columns each: ``[BM, BN]``."""
    if BN == QB:  # one block per row (the default tiles): a plain broadcast, no reshape
        return tl.broadcast_to(s, (BM, BN))
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BM, BN // QB, QB)), (BM, BN))


@triton.jit
def _load_state(ptr, scale_ptr, offs, sblk, smask, mask, KIND: tl.constexpr, IS_SQRT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr):
    """A state tile in fp32. 8-bit: the tile's rows hold ``BN // QB`` scale blocks each, at indices ``sblk``."""
    if KIND == 2:  # ptr: the codes
        y = _code_decode(tl.load(ptr + offs, mask=mask, other=0), IS_SQRT)
        y = y * _per_block(tl.load(scale_ptr + sblk, mask=smask, other=1.0), BM, BN, QB)
        if IS_SQRT:
            y = y * y
        return y
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_state(ptr, scale_ptr, offs, sblk, smask, mask, x, key, idx, KIND: tl.constexpr, SR: tl.constexpr,
                 IS_SQRT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr):
    """Store an updated fp32 state tile as its kind; ``SR``: the second moment, rounded stochastically. 8-bit:
    the tile's rows hold ``BN // QB`` scale blocks each, at indices ``sblk`` ``[BM, BN // QB]`` (``smask``)."""
    if KIND == 2:
        if IS_SQRT:
            x = tl.sqrt_rn(x)
        ax = tl.where(mask, tl.abs(x), 0.0)
        if BN == QB:
            amax = tl.max(ax, axis=1, keep_dims=True)  # [BM, 1]
        else:
            amax = tl.max(tl.reshape(ax, (BM, BN // QB, QB)), axis=2)
        s = tl.where(amax > 0, tl.div_rn(amax, 1.96875 if IS_SQRT else 1.9375), 1.0)  # block max -> q_max
        y = tl.div_rn(x, _per_block(s, BM, BN, QB))
        noise = _hash_bits(key, idx, 16).to(tl.int32) if SR else 0
        tl.store(ptr + offs, _code_encode(y, noise, SR, IS_SQRT), mask=mask)
        tl.store(scale_ptr + sblk, s, mask=smask)
    elif KIND == 1:
        if SR:
            x = _round_stochastic(x, _hash_bits(key, idx, 16), 16)
        else:
            x = _round_bf16(x)
        tl.store(ptr + offs, x.to(tl.bfloat16), mask=mask)  # exact: the low 16 bits are already zero
    else:
        tl.store(ptr + offs, x, mask=mask)


# noise keys and offsets are data: a value of 1 must not become a compile-time constant (no .to() on those)
@triton.jit(do_not_specialize=["key_w", "key_v", "idx_off"])
def _forge_linear_kernel(
    pid_m, pid_n,
    dy_ptr, x_ptr, w_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, acc_ptr, norm_ptr, bad_ptr,
    N, OUT, IN, S_COLS,
    s_dyn, s_dyo, s_xn, s_xi, s_wo, s_wi,
    lr, beta1, beta2, omb1, omb2, eps, wd, bc1, bc2_sqrt, key_w, key_v, coef, idx_off,
    FROM_GRAD: tl.constexpr, HAS_ACC: tl.constexpr, RULE: tl.constexpr, LOWP: tl.constexpr,
    IS_BF16: tl.constexpr, W_BF16: tl.constexpr,
    M_KIND: tl.constexpr, V_KIND: tl.constexpr, W_SR: tl.constexpr, G_LOWP: tl.constexpr, ACC_LOWP: tl.constexpr,
    TENSOR_CORES: tl.constexpr, HAS_M: tl.constexpr, NESTEROV: tl.constexpr, FIRST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PIDS_GIVEN: tl.constexpr = False,
):
    """Tile ``(pid_m, pid_n)`` of a weight: its ``dW`` (or given gradient) and update. Launched on the grid ``(row
    tiles, column tiles)`` of one weight, the tile is the program's (the ``pid`` arguments are then ignored: pass 0);
    called from :func:`_forge_group_kernel` with ``PIDS_GIVEN``, the given one. RULE: 0 AdamW, 1 Lion, 2 SGD (beta1 =
    momentum, beta2 = dampening; HAS_M: a momentum buffer in m_ptr; FIRST: the buffer's first step, which takes the
    direction as it is, as torch.optim.SGD does). ``omb1``/``omb2``: 1 - beta1 / 1 - beta2 computed on the host in
    fp64, as torch.optim passes them (1 - fp32(0.99) is 1e-6 off)."""
    if not PIDS_GIVEN:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < OUT
    cmask = cols < IN
    g = tl.zeros((BM, BN), dtype=tl.float32)
    if not FROM_GRAD:  # else the gradient is given (in acc_ptr): an update kernel for any tensor
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
        # accumulated in the gradient's dtype, as autograd sums a bf16/fp16 .grad (and the twin)
        if ACC_LOWP == 1:
            g = _round_bf16(g)
        elif ACC_LOWP == 2:
            g = g.to(tl.float16).to(tl.float32)
    tl.atomic_add(norm_ptr, tl.sum(tl.sum(g * g, axis=1), axis=0))
    nonfinite = mask & ((g != g) | (tl.abs(g) == float("inf")))
    finite = tl.sum(tl.sum(nonfinite.to(tl.int32), axis=1), axis=0) == 0
    if finite:
        g = g * coef  # the clip coefficient (after the norm, which is logged unclipped)
        if G_LOWP == 1:  # a bf16 gradient scaled as torch scales it: in fp32, rounded back to bf16
            g = _round_bf16(g)
        elif G_LOWP == 2:
            g = g.to(tl.float16).to(tl.float32)
        # weight and state are contiguous (the wrappers check), so the weight offsets index the state too, and are
        # each element's index in the parameter (row-major) for the rounding noise, as the twin hashes it; one
        # [BM, BN] index tensor in registers instead of three
        soffs = offs
        idx = offs.to(tl.uint32, bitcast=True) + idx_off.to(tl.uint32, bitcast=True)
        # 8-bit scales: [OUT, S_COLS], one per row and 64-column block; a tile row spans BN // 64 of them
        bidx = pid_n * (BN // 64) + tl.arange(0, BN // 64)
        sblk = rows[:, None] * S_COLS + bidx[None, :]
        smask = rmask[:, None] & (bidx < S_COLS)[None, :]
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_M:
            m = _load_state(m_ptr, ms_ptr, soffs, sblk, smask, mask, M_KIND, False, BM, BN, 64)
        if RULE == 2:  # SGD: L2 decay into the direction, then momentum (torch.optim.SGD's order)
            d = g + wd * w
            if HAS_M:
                if FIRST:
                    m = d
                else:
                    m = m * beta1 + omb2 * d
                if NESTEROV:
                    d = d + beta1 * m
                else:
                    d = m
            w = w - lr * d
        elif RULE == 1:  # Lion
            w = w * (1.0 - lr * wd)
            c = m + (g - m) * omb1
            u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
            w = w - lr * u
            m = m + (g - m) * omb2
        else:  # AdamW
            w = w * (1.0 - lr * wd)
            v = _load_state(v_ptr, vs_ptr, soffs, sblk, smask, mask, V_KIND, True, BM, BN, 64)
            m = m + (g - m) * omb1  # torch's lerp_ formula for weights < 0.5 (beta1 > 0.5; ulp-level otherwise)
            v = v * beta2 + omb2 * g * g
            denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
            w = w + tl.div_rn(-(lr / bc1) * m, denom)
            _store_state(v_ptr, vs_ptr, soffs, sblk, smask, mask, v, key_v.to(tl.uint32, bitcast=True), idx,
                         V_KIND, True, True, BM, BN, 64)
        if HAS_M:
            _store_state(m_ptr, ms_ptr, soffs, sblk, smask, mask, m, key_v.to(tl.uint32, bitcast=True), idx,
                         M_KIND, False, False, BM, BN, 64)
        if W_BF16 and W_SR:
            w = _round_stochastic(w, _hash_bits(key_w.to(tl.uint32, bitcast=True), idx, 16), 16)
        elif W_BF16:
            w = _round_bf16(w)
        tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(bad_ptr, 1)


_launch_linear = Launcher(_forge_linear_kernel)


def _rule_args(rule: str, hp: dict[str, Any], step: int) -> dict[str, Any]:
    """The kernel's rule constants and its (beta1, beta2, eps, bc1, bc2_sqrt) for ``rule``."""
    if rule not in K.KERNEL_RULES:
        raise ValueError(f"no Triton FORGE kernel for rule {rule!r}")
    if rule.startswith("sgd"):
        consts = dict(RULE=2, HAS_M=rule == "sgd_momentum", NESTEROV=bool(hp["nesterov"]), FIRST=step == 1)
        mom, damp = float(hp["momentum"]), float(hp["dampening"])
        return {"consts": consts, "scalars": (mom, damp, 1.0 - mom, 1.0 - damp, 0.0, 1.0, 1.0)}
    b1, b2 = (float(b) for b in hp["betas"])
    consts = dict(RULE=1 if rule == "lion" else 0, HAS_M=True, NESTEROV=False, FIRST=False)
    return {"consts": consts, "scalars": (b1, b2, 1.0 - b1, 1.0 - b2, float(hp.get("eps", 0.0)), float(1 - b1**step),
                                          float((1 - b2**step) ** 0.5))}


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a constexpr function now: ~6 µs per host call, three per launch
    return -(-a // b)


def _sums(sums: tuple[Tensor, Tensor] | None, device: torch.device) -> tuple[Tensor, Tensor]:
    """The (norm², skipped tiles) accumulators the kernel adds into atomically: the caller's, or fresh zeros."""
    if sums is None:
        return torch.zeros((), dtype=torch.float32, device=device), torch.zeros((), dtype=torch.int32, device=device)
    if sums[0].dtype != torch.float32 or sums[1].dtype != torch.int32:
        raise ValueError("the Triton FORGE kernels accumulate into fp32 (norm²) and int32 (skipped tiles) tensors")
    return sums


def _kind(t: Tensor) -> int:
    if t.dtype == torch.float32:
        return F32
    if t.dtype == torch.bfloat16:
        return BF16
    if t.dtype == K.Q_DTYPE:
        return Q8
    raise ValueError(f"the Triton FORGE kernel takes fp32, bf16 or 8-bit optimizer state; got {t.dtype}")


def _state_kinds(names: tuple[str, ...], m: Tensor, v: Tensor) -> tuple[int, int]:
    """``(M_KIND, V_KIND)``; where the rule keeps no state ``m`` and ``v`` are placeholder pointers the kernel never
    reads (the weight, which may be fp16: no state kind)."""
    return (_kind(m), _kind(v)) if names else (F32, F32)


def linear_weight_step(
    rule: str,
    dy: Tensor,
    x: Tensor,
    w: Tensor,
    st: dict[str, Tensor],
    hp: dict[str, Any],
    step: int,
    acc: Tensor | None = None,
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    sums: tuple[Tensor, Tensor] | None = None,
    coef: float = 1.0,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """Same contract as the torch twin: update ``w`` and ``st`` in place from ``dW = coef·(dyᵀx (+ acc))``; returns
    ``(Σ dW², number of tiles skipped for non-finite values)`` as device tensors (``sums``, fp32 and int32, added
    into and returned if given: no allocation per call). State in fp32, bf16 or 8-bit
    (``st`` then also holds ``<name>.scale``); bf16 weights rounded to nearest or, with ``stochastic_rounding``,
    stochastically with the twin's noise (a hash of ``seed`` and the element index)."""
    ra = _rule_args(rule, hp, step)
    n, out_f = dy.shape
    in_f = x.shape[1]
    names = K.RULES[rule][1]
    m = st[names[0]] if names else w  # w: a placeholder pointer where the rule keeps no state
    v = st.get("exp_avg_sq", m)
    if not (w.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
        raise ValueError("the Triton FORGE kernel takes contiguous weights and optimizer state")
    m_kind, v_kind = _state_kinds(names, m, v)
    norm, bad = _sums(sums, w.device)
    lowp = dy.dtype in (torch.bfloat16, torch.float16) and x.dtype == dy.dtype
    # the epilogue's weight and state tiles stay in registers; a tile row spans whole 8-bit scale blocks
    cfg = LINEAR_TILES["lowp" if lowp else "fp32"]
    bm, bn, bk = cfg["bm"], cfg["bn"], cfg["bk"]
    if bn % K.Q_BLOCK:
        raise ValueError(f"LINEAR_TILES: bn must be a multiple of {K.Q_BLOCK} (an 8-bit scale block); got {bn}")
    seeds = K.rounding_seeds(seed, names)
    m_scale = st.get(names[0] + ".scale", w) if names else w  # w: a placeholder pointer where no scales exist
    b1, b2, omb1, omb2, eps, bc1, bc2_sqrt = ra["scalars"]
    _launch_linear(
        (_cdiv(out_f, bm), _cdiv(in_f, bn)),
        0, 0, dy, x, w, *(t.view(torch.uint8) if t.dtype == K.Q_DTYPE else t for t in (m, v)),  # codes as bytes
        m_scale, st.get("exp_avg_sq.scale", m_scale),
        acc if acc is not None else w, norm, bad,
        n, out_f, in_f, _cdiv(in_f, K.Q_BLOCK),
        dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        float(hp["lr"]), b1, b2, omb1, omb2, eps, float(hp["weight_decay"]), bc1, bc2_sqrt,
        K.as_int32(K.noise_key(seeds["p"])), K.as_int32(K.noise_key(seeds[(names or ("p",))[-1]])), float(coef), 0,
        FROM_GRAD=False, HAS_ACC=acc is not None, LOWP=lowp, IS_BF16=dy.dtype == torch.bfloat16, **ra["consts"],
        W_BF16=w.dtype == torch.bfloat16, M_KIND=m_kind, V_KIND=v_kind, W_SR=bool(stochastic_rounding),
        # the gradient has the weight's dtype (bf16 weights: scaled and rounded back, as clip_grad_norm_ does)
        G_LOWP={torch.bfloat16: 1, torch.float16: 2}.get(w.dtype, 0) if coef != 1.0 else 0,
        ACC_LOWP=0 if acc is None else {torch.bfloat16: 1, torch.float16: 2}.get(acc.dtype, 0),
        BM=bm, BN=bn, BK=bk,
        # the interpreter's dot misreads bf16 operands; upcast there (exact products, the same fp32 sums)
        TENSOR_CORES=lowp and not _INTERPRETED,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return norm, bad


def linear_weight_step_split(
    rule: str,
    dy: Tensor,
    x: Tensor,
    w: Tensor,
    st: dict[str, Tensor],
    hp: dict[str, Any],
    step: int,
    acc: Tensor | None = None,
    *,
    rows_per_tile: int | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    sums: tuple[Tensor, Tensor] | None = None,
    coef: float = 1.0,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """:func:`linear_weight_step` split in two: each row tile of ``dW = dyᵀx (+ acc)`` by the library GEMM (cuBLAS
    on a GPU; in the weight's dtype, as autograd produces it), then its update by :func:`update_step`'s kernel. Two
    launches and one ``rows_per_tile``-row tile of ``dW`` in memory per tile, where the fused kernel keeps ``dW`` in
    registers; the choice when its tensor-core GEMM is slower than the library's (``optim_args="kernel=split"``).
    Same contract and signature as the torch twin :func:`memgrad_hf.kernels.forge.linear_weight_step`."""
    names = K.RULES[rule][1]
    sums = _sums(sums, w.device)
    rows = rows_per_tile or K.row_tiles(w.shape[0], w.shape[1])
    for r0, r1, tile in K.linear_weight_tiles(dy, x, rows, acc, w.dtype):
        update_step(rule, w[r0:r1], tile, K.state_slice(st, names, r0, r1), hp, step, coef=coef,
                    stochastic_rounding=stochastic_rounding, seed=seed, offset=r0 * w.shape[1], sums=sums)
    return sums


class _UpdateOperands(NamedTuple):
    """What the update kernel takes for one tensor, whichever way it is launched (one or many tensors per launch)."""

    p2: Tensor  # the parameter as rows x columns (a 1-row view of a vector)
    g2: Tensor
    m: Tensor  # first state tensor (codes as bytes), or p2 as a placeholder pointer where the rule keeps no state
    v: Tensor
    m_scale: Tensor  # 8-bit scales, or p2 as a placeholder
    v_scale: Tensor
    kinds: tuple[int, int]  # M_KIND, V_KIND
    bm: int
    bn: int
    consts: dict[str, Any]  # the rule's compile-time constants
    scalars: list[float]  # lr, beta1, beta2, 1 - beta1, 1 - beta2, eps, weight decay, bc1, sqrt(bc2)
    keys: list[int]  # weight noise key, state noise key, element offset (int32)


def _update_operands(rule: str, p: Tensor, g: Tensor, st: dict[str, Tensor], hp: dict[str, Any], step: int,
                     seed: int, offset: int) -> _UpdateOperands:
    names = K.RULES[rule][1]
    if not (p.is_contiguous() and g.is_contiguous() and all(v.is_contiguous() for v in st.values())):
        raise ValueError("the Triton FORGE update takes contiguous tensors")
    ra = _rule_args(rule, hp, step)
    cols = p.shape[-1] if p.dim() >= 2 else max(p.numel(), 1)
    as2d = lambda t: t.view(-1, cols) if t.dim() >= 2 and t.shape[-1] == cols else t.view(1, -1)  # noqa: E731
    codes = lambda t: t.view(torch.uint8) if t.dtype == K.Q_DTYPE else t  # noqa: E731
    p2, g2 = as2d(p), as2d(g)
    m = codes(as2d(st[names[0]])) if names else p2
    v = codes(as2d(st["exp_avg_sq"])) if "exp_avg_sq" in st else m
    scale = {k: st[k + ".scale"] for k in names if k + ".scale" in st}
    bm, bn = (64, 64) if p2.shape[0] > 1 else (1, 1024)  # a 1-row tensor (a norm's gain): wide tiles, no masked rows
    if scale:
        bm, bn = 64, K.Q_BLOCK  # 8-bit state: a tile's row is one scale block
    m_scale = scale.get(names[0], p2) if names else p2
    b1, b2, omb1, omb2, eps, bc1, bc2_sqrt = ra["scalars"]
    seeds = K.rounding_seeds(seed, names)
    return _UpdateOperands(
        p2, g2, m, v, m_scale, scale.get("exp_avg_sq", m_scale), _state_kinds(names, m, v), bm, bn, ra["consts"],
        [float(hp["lr"]), b1, b2, omb1, omb2, eps, float(hp["weight_decay"]), bc1, bc2_sqrt],
        [K.as_int32(K.noise_key(seeds["p"])), K.as_int32(K.noise_key(seeds[(names or ("p",))[-1]])),
         K.as_int32(offset)])


def update_step(
    rule: str,
    p: Tensor,
    g: Tensor,
    st: dict[str, Tensor],
    hp: dict[str, Any],
    step: int,
    *,
    coef: float = 1.0,
    stochastic_rounding: bool = False,
    seed: int = 0,
    offset: int = 0,
    sums: tuple[Tensor, Tensor] | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """The update of any parameter (or contiguous row block of one) from its given gradient ``g``, in one kernel and
    without a host sync: the twin of :func:`memgrad_hf.kernels.forge.update_step` (same signature). ``coef`` scales
    ``g`` after its norm is taken; ``offset``: index of ``p``'s first element in the whole parameter (noise)."""
    u = _update_operands(rule, p, g, st, hp, step, seed, offset)
    out_f, in_f = u.p2.shape
    norm, bad = _sums(sums, p.device)
    key_w, key_v, offset32 = u.keys
    _launch_linear(
        (_cdiv(out_f, u.bm), _cdiv(in_f, u.bn)),
        0, 0, u.g2, u.g2, u.p2, u.m, u.v, u.m_scale, u.v_scale, u.g2, norm, bad,
        0, out_f, in_f, _cdiv(in_f, K.Q_BLOCK),
        0, 0, 0, 0, u.p2.stride(0), u.p2.stride(1),
        *u.scalars, key_w, key_v, float(coef), offset32,
        FROM_GRAD=True, HAS_ACC=True, LOWP=False, IS_BF16=False, **u.consts,
        W_BF16=p.dtype == torch.bfloat16, M_KIND=u.kinds[0], V_KIND=u.kinds[1], W_SR=bool(stochastic_rounding),
        G_LOWP=_G_LOWP.get(g.dtype, 0) if coef != 1.0 else 0, ACC_LOWP=0,
        BM=u.bm, BN=u.bn, BK=16, TENSOR_CORES=False, num_warps=4, num_stages=1,
    )
    return norm, bad


@triton.jit
def _typed(addr, KIND: tl.constexpr):
    """An address from a table as a pointer to fp32 (0), bf16 (1), 8-bit codes (2) or fp16 (3)."""
    if KIND == 1:
        return addr.to(tl.pointer_type(tl.bfloat16))
    if KIND == 2:
        return addr.to(tl.pointer_type(tl.uint8))
    if KIND == 3:
        return addr.to(tl.pointer_type(tl.float16))
    return addr.to(tl.pointer_type(tl.float32))


@triton.jit
def _forge_group_kernel(
    ptrs, ints, floats, starts, n_tensors, norm_ptr, bad_ptr, coef,
    RULE: tl.constexpr, W_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
    W_SR: tl.constexpr, G_LOWP: tl.constexpr, HAS_M: tl.constexpr, NESTEROV: tl.constexpr, FIRST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, SEARCH_STEPS: tl.constexpr, ALIGNED: tl.constexpr,
):
    """:func:`update_step`'s tile for many tensors in one launch: program ``pid`` finds its tensor ``t`` (the last
    with ``starts[t] <= pid``, by binary search over the ``n_tensors + 1`` tile offsets), reads that tensor's pointers
    and values from the tables, and runs :func:`_forge_linear_kernel` on that tile as the one-tensor launch does.
    Tables, one row per tensor: ``ptrs`` int64 (p, g, m, v, m scales, v scales), ``ints`` int64 (rows, columns,
    scale columns, row stride, column stride (1), weight noise key, state noise key, element offset), ``floats`` fp32
    (lr, beta1, beta2, 1 - beta1, 1 - beta2, eps, weight decay, bias corrections 1 and sqrt 2).

    A pointer or stride read from a table tells the compiler nothing of its alignment, which the one-tensor launch
    gets from its arguments' specialization (16-byte aligned pointers, a row stride divisible by 16, a column stride
    of 1): without it, loads and stores are not vectorized. The tensors are contiguous (column stride 1, passed as
    such) and, with ``ALIGNED`` (checked on the host), their four tensor addresses and row stride are multiples of
    16, which the hints below restore."""
    pid = tl.program_id(0)
    lo = pid * 0
    hi = lo + n_tensors
    for _ in tl.static_range(SEARCH_STEPS):  # invariant: starts[lo] <= pid < starts[hi]
        mid = (lo + hi) // 2
        right = tl.load(starts + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    t = lo
    local = pid - tl.load(starts + t)
    row = ints + t * 8
    out_f = tl.load(row).to(tl.int32)
    in_f = tl.load(row + 1).to(tl.int32)
    tiles_n = (in_f + BN - 1) // BN
    prow = ptrs + t * 6
    w_ptr = _typed(tl.load(prow), W_KIND)
    g_ptr = _typed(tl.load(prow + 1), G_KIND)
    m_ptr = _typed(tl.load(prow + 2), M_KIND)
    v_ptr = _typed(tl.load(prow + 3), V_KIND)
    s_wo = tl.load(row + 3).to(tl.int32)
    if ALIGNED:
        w_ptr = tl.multiple_of(w_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        s_wo = tl.multiple_of(s_wo, 16)
    frow = floats + t * 9
    _forge_linear_kernel(
        local // tiles_n, local % tiles_n,
        g_ptr, g_ptr, w_ptr, m_ptr, v_ptr,
        _typed(tl.load(prow + 4), 0), _typed(tl.load(prow + 5), 0), g_ptr, norm_ptr, bad_ptr,
        0, out_f, in_f, tl.load(row + 2).to(tl.int32), 0, 0, 0, 0, s_wo, 1,
        tl.load(frow), tl.load(frow + 1), tl.load(frow + 2), tl.load(frow + 3), tl.load(frow + 4), tl.load(frow + 5),
        tl.load(frow + 6), tl.load(frow + 7), tl.load(frow + 8),
        tl.load(row + 5).to(tl.int32), tl.load(row + 6).to(tl.int32), coef, tl.load(row + 7).to(tl.int32),
        True, True, RULE, False, False, W_KIND == 1, M_KIND, V_KIND, W_SR, G_LOWP, 0,
        False, HAS_M, NESTEROV, FIRST, BM, BN, 16, True,
    )


_G_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 3}
_G_LOWP = {torch.bfloat16: 1, torch.float16: 2}  # a low-precision gradient, rounded back after clipping scales it
_GROUP_FAILED: list[str] = []  # why the grouped kernel could not be built, once: update_many then launches per tensor


def update_many(
    rule: str,
    items: list[tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Any], int, int, int]],
    *,
    coef: float = 1.0,
    stochastic_rounding: bool = False,
    sums: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`update_step` for many tensors, one launch per kind of tensor instead of one per tensor (a step's
    launches cost the host ~100 µs each on a GPU at batch 1, where the host bounds the step). ``items``: ``(p, g,
    st, hp, step, seed, offset)`` as :func:`update_step` takes them, all on one device; ``coef`` and
    ``stochastic_rounding`` are shared. The same arithmetic per element as one :func:`update_step` per item (the
    norm² sums may add in another order). Its torch twin is that loop (:func:`memgrad_hf.kernels.forge.update_step`
    per item)."""
    sums = _sums(sums, items[0][0].device) if items else _sums(sums, torch.device("cpu"))

    def one_by_one(some: Any) -> None:
        for p, g, st, hp, step, seed, offset in some:
            update_step(rule, p, g, st, hp, step, coef=coef, stochastic_rounding=stochastic_rounding, seed=seed,
                        offset=offset, sums=sums)

    groups: dict[tuple, list] = {}
    for p, g, st, hp, step, seed, offset in items:
        if (p.dtype not in (torch.float32, torch.bfloat16) or g.dtype not in _G_KINDS or p.numel() >= 1 << 31
                or not (p.is_contiguous() and g.is_contiguous() and all(v.is_contiguous() for v in st.values()))):
            one_by_one([(p, g, st, hp, step, seed, offset)])  # (its errors and its wider dtypes)
            continue
        u = _update_operands(rule, p, g, st, hp, step, seed, offset)
        out_f, in_f = u.p2.shape
        row_ptrs = [t.data_ptr() for t in (u.p2, u.g2, u.m, u.v, u.m_scale, u.v_scale)]
        aligned = all(a % 16 == 0 for a in row_ptrs[:4]) and u.p2.stride(0) % 16 == 0  # (the kernel's hints)
        key = (p.device, aligned, u.bm, u.bn, _kind(p), _G_KINDS[g.dtype], *u.kinds,
               _G_LOWP.get(g.dtype, 0) if coef != 1.0 else 0, tuple(sorted(u.consts.items())))
        row_ints = [out_f, in_f, _cdiv(in_f, K.Q_BLOCK), u.p2.stride(0), u.p2.stride(1), *u.keys]
        tiles = _cdiv(out_f, u.bm) * _cdiv(in_f, u.bn)
        # (the tensors themselves stay referenced until the launch: their addresses are in the tables)
        groups.setdefault(key, []).append((row_ptrs, row_ints, u.scalars, tiles, u,
                                           (p, g, st, hp, step, seed, offset)))
    norm, bad = sums
    for (dev, aligned, bm, bn, w_kind, g_kind, m_kind, v_kind, g_lowp, consts), rows in groups.items():
        if _GROUP_FAILED:  # (the grouped kernel failed to build here once: one launch per tensor)
            one_by_one(r[5] for r in rows)
            continue
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + r[3])
        ptrs = torch.tensor([r[0] for r in rows], dtype=torch.int64).to(dev, non_blocking=True)
        ints = torch.tensor([r[1] for r in rows], dtype=torch.int64).to(dev, non_blocking=True)
        floats = torch.tensor([r[2] for r in rows], dtype=torch.float32).to(dev, non_blocking=True)
        starts_t = torch.tensor(starts, dtype=torch.int32).to(dev, non_blocking=True)
        try:
            _forge_group_kernel[(starts[-1],)](
                ptrs, ints, floats, starts_t, len(rows), norm, bad, float(coef),
                W_KIND=w_kind, G_KIND=g_kind, M_KIND=m_kind, V_KIND=v_kind, W_SR=bool(stochastic_rounding),
                G_LOWP=g_lowp, **dict(consts), BM=bm, BN=bn, SEARCH_STEPS=max(1, len(rows).bit_length()),
                ALIGNED=aligned, num_warps=4, num_stages=1,
            )
        except Exception as e:  # a compiler or platform problem, raised before the kernel ran: nothing was written
            _GROUP_FAILED.append(repr(e))
            logger.warning("memgrad_hf: the grouped FORGE update kernel is unavailable (%s); launching one kernel per "
                           "tensor instead.", str(e).strip().splitlines()[-1] if str(e).strip() else repr(e))
            one_by_one(r[5] for r in rows)
    return sums
