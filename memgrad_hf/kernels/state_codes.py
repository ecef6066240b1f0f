"""8-bit optimizer state: block-scaled 8-bit float codes, one fp32 scale per ``Q_BLOCK`` consecutive elements of a row.

Two formats, both with 3 exponent bits (7 binades down from the block's largest value, then even steps down to
~2^-11 of it), stored as ``uint8``:

- **first moments** (signed): 1 sign, 3 exponent, 4 mantissa bits (e3m4), rounded to nearest: within 2^-5 relative;
- **sqrt(second moments)** (never negative, a denominator): 3 exponent, 5 mantissa bits (e3m5), rounded
  stochastically (``v·β2`` moves by less than a code step per step; rounded to nearest it would never decay); a
  positive value never becomes 0 (it gets at least the smallest code), a zero stays 0.

Why these: after 200 Trainer steps of a small Llama, fake-quantized ``torch.optim.AdamW`` sits 0.24 of its move away
from fp32 AdamW with float8-e4m3 for both (3 mantissa bits, the format before 2026-11-27), 0.11 with these
(bitsandbytes' 8-bit AdamW: 0.10). Linear int8 codes would flush the small values of a block to zero; the exponent
keeps every value above ~2^-12 of its block's largest.

A code is ``(e - E_MIN) << M`` plus the value's mantissa on ``M`` bits (an integer in ``[0, 2^(M+1))``), where ``e``
is the value's binade clamped below at ``E_MIN``: one integer formula for normal and subnormal values, whose carry
on rounding up runs into the next binade by itself. Blocks run along the last dimension only, so any row slice of a
weight (the fused tiles) carries whole blocks with its own slice of the scales. The same arithmetic runs in the
compiled CPU update (:mod:`memgrad_hf.kernels.forge_compiled`) and in the Triton kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

Q_BLOCK = 64
Q_DTYPE = torch.uint8
E_MIN = -6  # the smallest normal binade: 7 binades up to [1, 2), which holds the block's largest value
NOISE_BITS = 16  # stochastic rounding: the mantissa's dropped fraction against 16 bits of noise
LEGACY_DTYPE = torch.float8_e4m3fn  # 8-bit state saved before 2026-11-27: e4m3 codes, block max at 224


def mantissa_bits(positive: bool) -> int:
    """4 for a signed code (first moments), 5 for a non-negative one (sqrt of second moments)."""
    return 5 if positive else 4


def q_max(positive: bool) -> float:
    """The largest code's value (a block's largest magnitude maps here): 1.9375 signed, 1.96875 non-negative."""
    m = mantissa_bits(positive)
    return (2 ** (m + 1) - 1) / 2**m


def scale_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the per-block scales for an 8-bit state of ``shape`` (blocks of Q_BLOCK along the last dim)."""
    return (*shape[:-1], -(-shape[-1] // Q_BLOCK))


def _pow2(e: Tensor) -> Tensor:
    """``2.0**e`` for int32 ``e`` in fp32's normal range, exactly (built from the exponent bits)."""
    return ((e + 127) * (1 << 23)).view(torch.float32)


def encode(y: Tensor, noise: Tensor | None, positive: bool) -> Tensor:
    """Codes (uint8) of fp32 ``y`` already divided by its block's scale (``|y| <= q_max``, larger is clamped).

    ``noise``: int32 in ``[0, 2^NOISE_BITS)`` per element for stochastic rounding (unbiased to 2^-16 of a code step),
    ``None`` for nearest (ties to even). ``positive``: the e3m5 format; positive values below the smallest code get
    it. Element-wise torch ops only: the compiled update uses it as is."""
    m = mantissa_bits(positive)
    # in place where it can be: eager torch spends more on allocating each temporary than on the op itself
    a = y.abs().clamp_(max=q_max(positive))
    if positive:  # a denominator: no positive value flushes to 0. Zeros stay 0: in an all-zero block (scale 1) the
        # smallest code would give a row without a gradient so far (an unseen token's embedding) a sqrt(v) far above
        # what its first gradients bring, holding its updates back for thousands of steps
        a = torch.where(a > 0, a.clamp(min=2.0 ** (E_MIN - m)), a)
    e = (a.view(torch.int32) >> 23).clamp_(min=127 + E_MIN)  # 127 + floor(log2 a); 0 -> E_MIN
    q = (m + 254 - e).mul_(1 << 23)  # exponent bits of 2^(m - floor(log2 a)) ...
    a.mul_(q.view(torch.float32))  # ... times a: the mantissa in units of the code step, [0, 2^(m+1)), exact
    if noise is None:
        q.copy_(a.round_())  # to nearest, ties to even
    else:  # a's fraction against the noise: exact integers (a·2^16 < 2^22)
        q.copy_(a.mul_(2.0**NOISE_BITS)).add_(noise).bitwise_right_shift_(NOISE_BITS)
    code = q.add_(e.sub_(127 + E_MIN).mul_(1 << m))
    if not positive:  # the sign bit of y (-0.0 included) as bit 7
        code.add_(torch.bitwise_right_shift(y.view(torch.int32), 24, out=e).bitwise_and_(0x80))
    return code.to(torch.uint8)


def decode(codes: Tensor, positive: bool) -> Tensor:
    """fp32 values of ``codes`` (before the block's scale), exactly. Element-wise torch ops (see :func:`encode`)."""
    m = mantissa_bits(positive)
    c = codes.to(torch.int32)
    mag = c if positive else c & 0x7F
    f, q = mag >> m, mag & ((1 << m) - 1)
    val = torch.where(f > 0, q + (1 << m), q).float() * _pow2(f.clamp(min=1) - 1 + E_MIN - m)
    return val if positive else torch.where(c >= 0x80, -val, val)


_TABLES: dict[tuple[torch.device, bool], Tensor] = {}


def _lookup(codes: Tensor, positive: bool) -> Tensor:
    """:func:`decode` by a 256-entry table (the eager path: one gather instead of ~10 passes)."""
    table = _TABLES.get((codes.device, positive))
    if table is None:
        table = _TABLES[codes.device, positive] = decode(torch.arange(256, device=codes.device), positive)
    return table.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _blocks(x: Tensor) -> Tensor:
    """``x`` zero-padded to whole blocks, as ``[..., blocks, Q_BLOCK]``."""
    pad = (-x.shape[-1]) % Q_BLOCK
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(*x.shape[:-1], -1, Q_BLOCK)


def quantize_8bit(x: Tensor, seed: int | None = None, positive: bool = False, *,
                  offset: int = 0) -> tuple[Tensor, Tensor]:
    """fp32 ``x`` (at least 1-D) -> ``(codes, scales)``: codes of ``x`` over its block's scale (block max / q_max).

    ``positive``: ``x >= 0`` is a denominator (sqrt of a second moment): the e3m5 format, no positive value becomes
    0. With ``seed`` the codes are rounded stochastically (``E[dequantize] = x``), else to nearest. Per element,
    ``|dequantize - x| <= 2^-(M+1)·|x| + 2^(-7-M)·s`` (nearest; ``2^(-6-M)·s`` with ``positive``, whose floor lifts
    the smallest values) or ``< 2^-M·|x| + 2^(-6-M)·s`` (stochastic), ``M`` the mantissa bits (4 signed, 5 positive)
    and ``s`` the block's largest magnitude. The noise of element ``i``
    hashes ``(seed, offset + i)``, as for bf16 (row blocks with their offsets equal one call on the whole).

    Example::

        codes, scale = quantize_8bit(exp_avg)            # uint8 codes, fp32 scale per 64 elements of a row
        exp_avg_again = dequantize_8bit(codes, scale)    # within 2^-5 relative
    """
    from memgrad_hf.kernels.forge import hash_bits  # (forge imports this module)

    x = x.float()
    amax = _blocks(x).abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / q_max(positive), torch.ones_like(amax))
    y = (_blocks(x) / scale.unsqueeze(-1)).reshape(*x.shape[:-1], -1)[..., :x.shape[-1]]
    noise = None if seed is None else hash_bits(seed, offset, y.shape, NOISE_BITS, x.device)
    return encode(y, noise, positive), scale


def dequantize_8bit(codes: Tensor, scale: Tensor, positive: bool = False) -> Tensor:
    """Inverse of :func:`quantize_8bit`: fp32 values of the codes times their block's scale."""
    y = _blocks(_lookup(codes, positive))
    y.mul_(scale.unsqueeze(-1))  # a fresh fp32 tensor: scale it in place
    return y.reshape(*codes.shape[:-1], -1)[..., :codes.shape[-1]]


def dequantize_legacy(values: Tensor, scale: Tensor) -> Tensor:
    """fp32 state from a checkpoint saved before 2026-11-27 (e4m3 codes, already cast to a float dtype by
    ``torch.optim``'s loading, and their scales): to be quantized again in the current format."""
    y = _blocks(values.float()) * scale.float().unsqueeze(-1)
    return y.reshape(*values.shape[:-1], -1)[..., :values.shape[-1]]
