"""FORGE math, torch path: element-wise update rules, and the weight step fused into a linear layer's backward.

The rules reproduce ``torch.optim``'s single-tensor op order exactly (the ``_single_tensor_*`` functions
of ``torch/optim/adamw.py`` and its siblings), so that in fp32 an update
applied to row slices of a weight equals ``torch.optim.AdamW`` on the whole weight bit for bit. Nothing here knows
about optimizers' bookkeeping or transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# 8-bit state's codes live in state_codes; the rules' callers reach them through this module too
from memgrad_hf.kernels.state_codes import (  # noqa: F401
    Q_BLOCK,
    Q_DTYPE,
    dequantize_8bit,
    quantize_8bit,
    scale_shape,
)

# ---------------------------------------------------------------------------------------------- rules


def adamw_(p: Tensor, g: Tensor, st: dict[str, Tensor], hp: dict[str, Any], step: int) -> None:
    """AdamW on (a slice of) a parameter, in place; ``st`` holds ``exp_avg`` and ``exp_avg_sq`` slices."""
    lr, (b1, b2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    m, v = st["exp_avg"], st["exp_avg_sq"]
    gm = g if m.dtype == g.dtype else g.to(m.dtype)
    if wd != 0:
        p.mul_(1 - lr * wd)
    m.lerp_(gm, 1 - b1)
    v.mul_(b2).addcmul_(gm, gm, value=1 - b2)
    bc1 = 1 - b1**step
    bc2 = 1 - b2**step
    denom = v.sqrt().div_(bc2**0.5).add_(eps)  # in place: the same ops and values, one temporary
    p.addcdiv_(m if m.dtype == p.dtype else m.to(p.dtype), denom.to(p.dtype), value=-(lr / bc1))


def lion_(p: Tensor, g: Tensor, st: dict[str, Tensor], hp: dict[str, Any], step: int) -> None:
    """Lion (Chen et al. 2023): ``p -= lr·sign(β1·m + (1-β1)·g)``, then ``m = β2·m + (1-β2)·g``."""
    lr, (b1, b2), wd = hp["lr"], hp["betas"], hp["weight_decay"]
    m = st["exp_avg"]
    gm = g if m.dtype == g.dtype else g.to(m.dtype)
    if wd != 0:
        p.mul_(1 - lr * wd)
    update = m.lerp(gm, 1 - b1).sign_()
    p.add_(update.to(p.dtype), alpha=-lr)
    m.lerp_(gm, 1 - b2)


def sgd_(p: Tensor, g: Tensor, st: dict[str, Tensor], hp: dict[str, Any], step: int) -> None:
    """SGD with momentum, dampening, Nesterov and (L2) weight decay in ``torch.optim.SGD``'s op order; the momentum
    buffer starts as the first step's direction, as torch's does (its ``None`` buffer is a fresh one here)."""
    lr, mom, damp, wd = hp["lr"], hp["momentum"], hp["dampening"], hp["weight_decay"]
    d = g if wd == 0 else g.add(p, alpha=wd)
    if mom != 0:
        buf = st["momentum_buffer"]
        if step == 1:
            buf.copy_(d)
        else:
            buf.mul_(mom).add_(d, alpha=1 - damp)
        d = d.add(buf, alpha=mom) if hp["nesterov"] else buf
    p.add_(d, alpha=-lr)


RULES: dict[str, tuple[Callable[..., None], tuple[str, ...]]] = {
    # name: (update, state tensors it keeps per parameter)
    "adamw": (adamw_, ("exp_avg", "exp_avg_sq")),
    "lion": (lion_, ("exp_avg",)),
    "sgd": (sgd_, ()),  # momentum 0 in every group: no state
    "sgd_momentum": (sgd_, ("momentum_buffer",)),
}
KERNEL_RULES = ("adamw", "lion", "sgd", "sgd_momentum")  # what the fused kernels (Triton; compiled CPU) implement


# ---------------------------------------------------------------------------------------------- precision


def round_to_bf16_stochastic(x: Tensor, seed: int, *, offset: int = 0) -> Tensor:
    """fp32 -> bf16 with stochastic rounding: ``E[result] = x`` (unbiased), reproducible from ``seed``.

    Adds 16 bits of noise to the fp32 bit pattern and truncates the low 16 bits: a value a fraction ``f`` of the way
    between two bf16 neighbours rounds up with probability ``f``. The noise of element ``i`` (row-major) is a hash of
    ``(seed, offset + i)`` (:func:`hash_bits`): rounding row blocks of a tensor with their element offsets gives
    exactly the result of one call on the whole, on any device and in the Triton kernel alike."""
    return _sr_truncate(x, seed, offset).to(torch.bfloat16)


def as_int32(v: int) -> int:
    """``v`` mod 2^32 read as a signed int32 (how the uint32 noise keys travel as int32 kernel arguments)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


# lowbias32 (C. Wellons' integer-hash search): a cheap 32-bit mixer with low bias; the Triton kernel runs the same
# on uint32, torch here on int32 with the arithmetic shifts masked to logical ones
_H1, _H2 = 0x7FEB352D, 0x846CA68B


def _lowbias32(v: int) -> int:
    v &= 0xFFFFFFFF
    v ^= v >> 16
    v = (v * _H1) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * _H2) & 0xFFFFFFFF
    return v ^ (v >> 16)


def noise_key(seed: int) -> int:
    """The 32-bit key a rounding ``seed`` contributes to :func:`hash_bits` (itself hashed: nearby seeds, such as
    consecutive steps, give unrelated streams)."""
    return _lowbias32(seed)


def hash_bits(seed: int, offset: int, shape: torch.Size | tuple[int, ...], bits: int,
              device: torch.device | str) -> Tensor:
    """int32 noise in ``[0, 2^bits)``, ``1 <= bits <= 31``: element ``i`` (row-major) gets the low ``bits`` of
    ``lowbias32(noise_key(seed) + offset + i)`` (mod 2^32).

    A pure function of (seed, element index), not a generator stream: the same on CPU and GPU, in the Triton kernel
    and for any tiling of a tensor. ~1.2 ns per element on one CPU core (as fast as torch's generator)."""
    n = 1
    for d in shape:
        n *= d
    x = _iota(n, torch.device(device)).add(as_int32(noise_key(seed) + offset))
    tmp = torch.empty_like(x)
    for shift, mul in ((16, _H1), (15, _H2)):  # x ^= x >> shift (logical); x *= mul
        torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp.bitwise_and_((1 << (32 - shift)) - 1))
        x.mul_(as_int32(mul))  # int32 products wrap mod 2^32, as uint32 ones do
    # last round, x ^= x >> 16: for the low 16 bits an arithmetic shift does what a logical one does
    torch.bitwise_right_shift(x, 16, out=tmp)
    x.bitwise_xor_(tmp if bits <= 16 else tmp.bitwise_and_(0xFFFF))
    return x.bitwise_and_((1 << bits) - 1).view(shape)


_IOTAS: dict[torch.device, Tensor] = {}


def _iota(n: int, device: torch.device) -> Tensor:
    """``arange(n)`` in int32 as a view of a cached, grown-on-demand buffer (blocks reuse it: no per-call fill)."""
    buf = _IOTAS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.arange(max(n, 1 << 18), dtype=torch.int32, device=device)
        _IOTAS[device] = buf
    return buf[:n]


def _sr_truncate(x: Tensor, seed: int, offset: int) -> Tensor:
    """fp32 ``x`` with noise added below bit 16 and the low 16 bits cleared (so the cast to bf16 is exact).
    One temporary of ``x``'s size: the noise buffer becomes the result. On the bit pattern, +-inf stay +-inf and
    torch's NaN stays NaN (the noise never reaches the exponent or the top mantissa bit); finite values may round
    up to +-inf only past bf16's largest value, as rounding should."""
    out = hash_bits(seed, offset, x.shape, 16, x.device)
    out.add_(x.contiguous().view(torch.int32)).bitwise_and_(-65536)  # -65536 == 0xFFFF0000 as int32
    return out.view(torch.float32)


def state_slice(st: dict[str, Tensor], names: tuple[str, ...], r0: int, r1: int) -> dict[str, Tensor]:
    """Rows ``r0:r1`` of the state tensors ``names`` (and of their 8-bit scales, if any); the tensors themselves
    where the rows are all of them (one update per small weight: no slicing op per tensor on the host)."""
    if names and r0 == 0 and r1 == st[names[0]].shape[0]:
        return {k: st[k] for k in (*names, *(n + ".scale" for n in names)) if k in st}
    out = {n: st[n][r0:r1] for n in names}
    out.update({n + ".scale": st[n + ".scale"][r0:r1] for n in names if n + ".scale" in st})
    return out


# Updates run on row blocks of about this many fp32 bytes: the rule's temporaries, the fp32 copies of reduced-
# precision state and the rounding noise then stay small (and cache-resident) instead of tile-sized. On a GPU, where
# each block costs kernel launches rather than cache misses, blocks are larger.
SUB_BLOCK_BYTES = 1 << 20
GPU_SUB_BLOCK_BYTES = 16 << 20


def rounding_seeds(seed: int, names: tuple[str, ...]) -> dict[str, int]:
    """The noise seed of each stochastically rounded tensor of one update: the weight ``p``, and state ``names[i]``."""
    return {"p": seed, **{n: seed * 7 + i + 1 for i, n in enumerate(names)}}


def apply_rule(
    rule: str,
    p: Tensor,
    g: Tensor,
    st: dict[str, Tensor],
    hp: dict[str, Any],
    step: int,
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> None:
    """Run ``rule`` on (a slice of) ``p`` in fp32 whatever the storage dtypes, and store the results back.

    fp32 storage is updated in place (bit-exact ``torch.optim`` op order). bf16 weights are rounded back to
    nearest, or stochastically with ``stochastic_rounding``. In bf16 state the second moment is rounded
    stochastically (with nearest rounding ``v·β2`` with β2 = 0.999 would never decay: the change is below bf16's
    spacing); first moments move by ``(1-β1)·(g-m)`` per step, far above it, and are rounded to nearest.

    ``offset``: index of ``p``'s first element in the whole parameter (``p`` is a contiguous row slice), so that the
    rounding noise, a hash of ``(seed, element index)``, does not depend on how the parameter is tiled. The work
    runs in row blocks of ``SUB_BLOCK_BYTES`` (element-wise rules: the same values as one pass). On CPU, reduced-
    precision state or weights take the compiled loop of :mod:`memgrad_hf.kernels.forge_compiled`."""
    update, names = RULES[rule]
    if p.dim() == 0:
        p, g, st = p.view(1), g.reshape(1), {k: v.view(1) for k, v in st.items()}
    limit = GPU_SUB_BLOCK_BYTES if p.is_cuda else SUB_BLOCK_BYTES
    row_len = p.numel() // max(p.shape[0], 1)
    rows = max(1, limit // max(4 * row_len, 1))
    seeds = rounding_seeds(seed, names)
    from memgrad_hf.kernels import forge_compiled  # (imports this module)

    fast = forge_compiled.enabled(p, st, rule)
    for r0 in range(0, p.shape[0], rows):
        r1 = min(r0 + rows, p.shape[0])
        if fast and forge_compiled.apply_rows(rule, p[r0:r1], g[r0:r1], {k: v[r0:r1] for k, v in st.items()}, hp,
                                              step, stochastic_rounding, seeds, offset + r0 * row_len):
            continue
        _apply_rows(update, names, p[r0:r1], g[r0:r1], {k: v[r0:r1] for k, v in st.items()}, hp, step,
                    stochastic_rounding, seeds, offset + r0 * row_len)


def compute_dtype(p: Tensor) -> torch.dtype:
    """The dtype an update is computed in: fp32 whatever the storage, fp64 for an fp64 weight (as ``torch.optim``)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _apply_rows(update: Callable[..., None], names: tuple[str, ...], p: Tensor, g: Tensor, st: dict[str, Tensor],
                hp: dict[str, Any], step: int, stochastic_rounding: bool, seeds: dict[str, int], offset: int):
    cd = compute_dtype(p)
    p32 = p if p.dtype == cd else p.to(cd)
    # 8-bit keeps sqrt(v), not v: half the dynamic range in the codes (small second moments next to a large one
    # survive), and a positive floor keeps every denominator away from 0
    st32 = {}
    for n in names:
        if st[n].dtype == Q_DTYPE:
            st32[n] = dequantize_8bit(st[n], st[n + ".scale"], positive=n == "exp_avg_sq")
            if n == "exp_avg_sq":
                st32[n].square_()
        else:
            st32[n] = st[n] if st[n].dtype == cd else st[n].to(cd)
    update(p32, g if g.dtype == cd else g.to(cd), st32, hp, step)
    _store(p, p32, stochastic_rounding, seeds["p"], offset)
    for n in names:
        if st[n].dtype == Q_DTYPE:  # 8-bit: the second moment rounded stochastically, as in bf16 (see above)
            if n == "exp_avg_sq":
                codes, scale = quantize_8bit(st32[n].sqrt_(), seeds[n], positive=True, offset=offset)
            else:
                codes, scale = quantize_8bit(st32[n])
            st[n].copy_(codes)
            st[n + ".scale"].copy_(scale)
        else:
            _store(st[n], st32[n], n == "exp_avg_sq", seeds[n], offset)


def _store(dst: Tensor, src32: Tensor, stochastic: bool, seed: int, offset: int) -> None:
    if dst.dtype == src32.dtype:
        if dst.data_ptr() != src32.data_ptr():
            dst.copy_(src32)
    elif dst.dtype == torch.bfloat16 and stochastic:
        dst.copy_(_sr_truncate(src32, seed, offset))  # low 16 bits are zero: the cast is exact
    else:
        dst.copy_(src32)


def norm_sq(t: Tensor, exact: bool = True) -> Tensor:
    """Σ t² as an fp64 scalar; non-finite exactly when ``t`` has a non-finite value (the finiteness check).

    ``exact``: accumulated in fp64. Otherwise (a norm that is only logged) fp32 tensors take one BLAS dot: ~1e-6
    relative, ~8x faster on CPU; if that overflows, the fp64 reduction decides finiteness."""
    if not exact and t.dtype == torch.float32 and t.is_contiguous() and t.numel() > 0:
        flat = t.view(-1)
        s = torch.dot(flat, flat).double()
        if bool(torch.isfinite(s)):
            return s
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


# ‖dyᵀx‖² through the token Grams when they cost at most 3/4 of forming dW, for at most this many tokens (two fp32
# [N x N] Grams: 2 x 64 MiB at the cap)
_GRAM_MAX_TOKENS = 4096


def gram_pays(tokens: int, out_features: int, in_features: int) -> bool:
    """Whether :func:`linear_grad_norm_sq` (``N²·(out+in)`` multiply-adds) is clearly cheaper than forming
    ``dW = dyᵀx`` (``N·out·in``) to take its norm: few tokens against wide layers (batch-1 fine-tuning, LM heads)."""
    return tokens <= _GRAM_MAX_TOKENS and 4 * tokens * (out_features + in_features) <= 3 * out_features * in_features


def _gram_f32(a: Tensor) -> Tensor:
    """``a·aᵀ`` in fp32 (``a``: ``[N, d]``); low-precision CUDA operands on the tensor cores with fp32 output."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, a.t(), out_dtype=torch.float32)
    a = a if a.dtype == torch.float64 else a.float()
    return a @ a.t()


def linear_grad_norm_sq(dy: Tensor, x: Tensor) -> Tensor:
    """``‖dyᵀx‖²_F`` as an fp64 scalar without forming ``dyᵀx`` (``dy``: ``[N, out]``, ``x``: ``[N, in]``):
    ``Σ_ab (dy·dyᵀ)_ab (x·xᵀ)_ab``, since ``‖Σ_a dy_a x_aᵀ‖² = Σ_ab (dy_a·dy_b)(x_a·x_b)``. Non-finite when ``dy`` or
    ``x`` is. fp32 Grams (of the operands as given: for low-precision operands the norm of the unrounded product,
    which the rounded ``dW`` matches to ~2^-9 per element, averaging out over the tensor)."""
    gy, gx = _gram_f32(dy), _gram_f32(x)
    return torch.dot(gy.view(-1), gx.view(-1)).double()


def apply_rule_chunked(
    rule: str,
    p: Tensor,
    g: Tensor,
    st: dict[str, Tensor],
    hp: dict[str, Any],
    step: int,
    *,
    coef: float = 1.0,
    chunk_elems: int = 1 << 20,
    stochastic_rounding: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> None:
    """:func:`apply_rule` on a whole tensor in flat chunks, so the rule's temporaries stay chunk-sized
    (element-wise rules: the result is identical to one call on the whole tensor). ``coef`` scales ``g``."""
    # 8-bit state blocks follow rows, not flat chunks: one call on the whole tensor
    if not (p.is_contiguous() and g.is_contiguous() and all(v.is_contiguous() for v in st.values())) or any(
            v.dtype == Q_DTYPE for v in st.values()):
        apply_rule(rule, p, g * coef if coef != 1.0 else g, st, hp, step,
                   stochastic_rounding=stochastic_rounding, seed=seed, offset=offset)
        return
    if p.dim() >= 2:  # row chunks, as a linear layer's tiles: the same rows take the same (eager or compiled) path
        row_len = p.numel() // max(p.shape[0], 1)
        rows = max(1, chunk_elems // max(row_len, 1))
        for r0 in range(0, p.shape[0], rows):
            r1 = min(r0 + rows, p.shape[0])
            gi = g[r0:r1] * coef if coef != 1.0 else g[r0:r1]
            apply_rule(rule, p[r0:r1], gi, {k: v[r0:r1] for k, v in st.items()}, hp, step,
                       stochastic_rounding=stochastic_rounding, seed=seed, offset=offset + r0 * row_len)
        return
    fp, fg = p.view(-1), g.reshape(-1)
    fst = {k: v.view(-1) for k, v in st.items()}
    for i in range(0, fp.numel(), chunk_elems):
        j = min(i + chunk_elems, fp.numel())
        gi = fg[i:j] * coef if coef != 1.0 else fg[i:j]
        apply_rule(rule, fp[i:j], gi, {k: v[i:j] for k, v in fst.items()}, hp, step,
                   stochastic_rounding=stochastic_rounding, seed=seed, offset=offset + i)


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
    exact_norm: bool = True,
    chunk_elems: int = 1 << 20,
    sums: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Update ``p`` (a parameter, or a contiguous row block of one starting at element ``offset``) and its state from
    its gradient ``g`` scaled by ``coef``, unless ``g`` has a non-finite value; returns ``(Σ g², skipped)`` (the
    norm before scaling; added into ``sums`` and returned if given). The torch twin of
    :func:`memgrad_hf.kernels.forge_triton.update_step`, which decides finiteness per tile on the device instead of
    once here."""
    g_sq = norm_sq(g, exact_norm)  # also the finiteness check (one pass)
    finite = bool(torch.isfinite(g_sq))
    if finite:
        apply_rule_chunked(rule, p, g, st, hp, step, coef=coef, chunk_elems=chunk_elems,
                           stochastic_rounding=stochastic_rounding, seed=seed, offset=offset)
    return _add_into(sums, g_sq, torch.tensor(0 if finite else 1, dtype=torch.int32, device=p.device))


def _add_into(sums: tuple[Tensor, Tensor] | None, norm: Tensor, bad: Tensor) -> tuple[Tensor, Tensor]:
    if sums is None:
        return norm, bad
    sums[0].add_(norm.to(sums[0].dtype))
    sums[1].add_(bad)
    return sums


# ---------------------------------------------------------------------------------------------- fused linear


def row_tiles(rows: int, cols: int, tile_bytes: int = 4 << 20) -> int:
    """Rows per weight-gradient tile so that one fp32 tile stays near ``tile_bytes`` (at least 16 rows; a multiple of
    128 from 128 on, so that every tile starts on a GEMM tile boundary and on a 16-byte-aligned column of ``dY``:
    e.g. 1524 rows of an 11008-wide weight would give cuBLAS unaligned operands in every tile but the first)."""
    r = max(16, min(rows, tile_bytes // max(4 * cols, 1)))
    return r if r == rows or r < 128 else r - r % 128


def linear_weight_tiles(
    dy: Tensor,
    x: Tensor,
    rows_per_tile: int,
    accumulated: Tensor | None = None,
    dtype: torch.dtype | None = None,
):
    """Yield ``(r0, r1, dW[r0:r1])`` for ``dW = dyᵀ·x`` one row block at a time (``dy``: ``[N, out]``, ``x``:
    ``[N, in]``), plus ``accumulated[r0:r1]`` (gradient accumulation) if given. Only one tile exists at a time.

    ``dtype`` is the dtype autograd would give the weight gradient (e.g. bf16 under autocast, then cast to the
    master weight's dtype as autograd's cast-backward does)."""
    out_features = dy.shape[1]
    for r0 in range(0, out_features, rows_per_tile):
        r1 = min(r0 + rows_per_tile, out_features)
        tile = (dy if r1 - r0 == out_features else dy[:, r0:r1]).t() @ x
        if dtype is not None and tile.dtype != dtype:
            tile = tile.to(dtype)
        if accumulated is not None:
            tile = tile + accumulated[r0:r1]
        yield r0, r1, tile


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
    rows_per_tile: int | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    exact_norm: bool = True,
    sums: tuple[Tensor, Tensor] | None = None,
    coef: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Update ``w`` and its state ``st`` in place with ``rule`` applied to ``dW = coef·(dyᵀ·x (+ acc))``, one row
    block at a time; returns ``(Σ (dyᵀ·x (+ acc))², tiles skipped)``, the norm before ``coef`` as
    :func:`update_step`'s (added into ``sums`` and returned if given). Tiles with a non-finite value are not applied
    (nor is their state). Each tile is formed as autograd forms the weight gradient (in the activations' dtype, cast
    to the weight's) and then scaled by ``coef`` (clipping) as ``clip_grad_norm_`` scales it: a tile kept for a
    clipping replay and one formed again here give the same update, bit for bit, and bf16 autocast equals torch.

    The torch twin of :func:`memgrad_hf.kernels.forge_triton.linear_weight_step` (same signature, plus
    ``exact_norm``: see :func:`norm_sq`)."""
    rows = rows_per_tile or row_tiles(w.shape[0], w.shape[1])
    norm = torch.zeros((), dtype=torch.float64, device=w.device)
    bad = torch.zeros((), dtype=torch.int32, device=w.device)
    names = RULES[rule][1]
    for r0, r1, tile in linear_weight_tiles(dy, x, rows, acc, w.dtype):
        tile_sq = norm_sq(tile, exact_norm)  # finite for every finite fp32 tile, so it doubles as the finiteness check
        norm += tile_sq
        if not bool(torch.isfinite(tile_sq)):
            bad += 1
            continue
        if coef != 1.0:
            tile = tile * coef
        apply_rule(rule, w[r0:r1], tile, state_slice(st, names, r0, r1), hp, step,
                   stochastic_rounding=stochastic_rounding, seed=seed, offset=r0 * w.shape[1])
    return _add_into(sums, norm, bad)
