"""Pure math, no transformers import.

Each op family has a torch implementation (the CPU path and the test oracle) and, where written, a Triton
twin with the same signature. :func:`backend` picks Triton for CUDA tensors and torch elsewhere;
``MEMGRAD_BACKEND=torch|triton`` forces one.
"""

from __future__ import annotations

import os

import torch

_BACKENDS = ("torch", "triton")


def backend(device: torch.device | str | None = None) -> str:
    """Return ``"torch"`` or ``"triton"`` for tensors on ``device``.

    ``MEMGRAD_BACKEND`` overrides the choice (``triton`` on CPU needs ``TRITON_INTERPRET=1``).
    """
    forced = os.environ.get("MEMGRAD_BACKEND", "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"MEMGRAD_BACKEND={forced!r} is not one of {_BACKENDS}; unset it or pick one.")
        return forced
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return "triton" if dev.type == "cuda" and triton_available() else "torch"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def head_impl(device: torch.device | str | None = None):
    """The module implementing the chunked-head ops for tensors on ``device``.

    On a GPU :mod:`memgrad_hf.kernels.head_triton` (Triton row kernels between cuBLAS GEMMs); elsewhere, or with
    ``MEMGRAD_BACKEND=torch``, the torch path :mod:`memgrad_hf.kernels.head` (GEMMs plus element-wise torch ops).
    Measured on an H100 (benchmarks/RESULTS.md, 2026-11-23): the Triton head is 2.0-2.7x faster than the torch path
    and 0.84-0.87x Liger's time; with bf16 weights its fused cross-entropy keeps an fp32 weight-gradient buffer
    (0.5 GiB at 128K x 1024), where the torch path walks the vocabulary in blocks. ``MEMGRAD_BACKEND=triton`` on CPU
    tensors needs ``TRITON_INTERPRET=1`` (slow; for tests).
    """
    if backend(device) == "triton":
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"MEMGRAD_BACKEND=triton on {dev.type} tensors: the Triton head kernel needs a GPU (or "
                "TRITON_INTERPRET=1 for the slow interpreter); unset MEMGRAD_BACKEND or set it to 'torch'."
            )
        from memgrad_hf.kernels import head_triton

        return head_triton
    from memgrad_hf.kernels import head

    return head


def titans_step_impl(device: torch.device | str | None = None):
    """The Titans ``memory_step`` for tensors on ``device``: the torch manual kernel
    (:func:`memgrad_hf.kernels.titans.memory_step`) on every device, unless ``MEMGRAD_BACKEND=triton`` asks for the
    Triton twin (:func:`memgrad_hf.kernels.titans_triton.memory_step`, Triton forward, torch-twin backward).

    Measured on an H100 (benchmarks/RESULTS.md, 2026-11-22): the Triton twin, one program per memory, is no faster
    than the torch kernel's batched cuBLAS GEMMs at D=64 and 2.2x slower at D=128, so it is opt-in. Both have the
    same signature and return values. Imported lazily so CPU-only installs never import Triton.
    """
    if backend(device) == "triton" and os.environ.get("MEMGRAD_BACKEND", "").strip().lower() == "triton":
        from memgrad_hf.kernels.titans_triton import memory_step
    else:
        from memgrad_hf.kernels.titans import memory_step
    return memory_step
