"""Triton helpers shared by the kernel families."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 -> nearest bf16 (ties to even), returned as fp32: bit arithmetic, so that compiled and interpreted kernels
    agree (the interpreter's fp32 -> bf16 cast truncates; a compiled cast rounds to nearest)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
