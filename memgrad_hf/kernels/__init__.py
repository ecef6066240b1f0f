"""Pure math, no transformers import.

Each op family has a torch implementation (the CPU path and the test oracle) and, where written, a Triton
twin with the same signature. :func:`backend` picks Triton for CUDA tensors and torch elsewhere;
``MEMGRAD_BACKEND=torch|triton`` forces one.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from memgrad_hf.kernels import smoke

log = logging.getLogger(__name__)

_BACKENDS = ("torch", "triton")


def backend(device: torch.device | str | None = None, forced: str | None = None) -> str:
    """Return ``"torch"`` or ``"triton"`` for tensors on ``device``.

    ``MEMGRAD_BACKEND`` overrides the choice (``triton`` on CPU needs ``TRITON_INTERPRET=1``); ``forced``: its value,
    if the caller has read it already.
    """
    forced = forced_backend() if forced is None else forced
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"MEMGRAD_BACKEND={forced!r} is not one of {_BACKENDS}; unset it or pick one.")
        return forced
    kind = _device_kind(device)
    return "triton" if kind == "cuda" and triton_available() else "torch"


def _device_kind(device: torch.device | str | None) -> str:
    """``device``'s type (``"cpu"`` for None), with no ``torch.device`` built where one is given: this runs per
    layer and step."""
    if isinstance(device, torch.device):
        return device.type
    return torch.device(device).type if device is not None else "cpu"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def head_impl(device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """The module implementing the chunked-head ops for tensors on ``device``.

    On a GPU :mod:`memgrad_hf.kernels.head_triton` (Triton row kernels between cuBLAS GEMMs); elsewhere, or with
    ``MEMGRAD_BACKEND=torch``, the torch path :mod:`memgrad_hf.kernels.head` (GEMMs plus element-wise torch ops).
    Measured on an H100 (benchmarks/RESULTS.md, 2026-11-23): the Triton head is 2.0-2.7x faster than the torch path
    and 0.84-0.87x Liger's time; with bf16 weights its fused cross-entropy keeps an fp32 weight-gradient buffer
    (0.5 GiB at 128K x 1024), where the torch path walks the vocabulary in blocks. ``MEMGRAD_BACKEND=triton`` on CPU
    tensors needs ``TRITON_INTERPRET=1`` (slow; for tests). fp64 weights (``dtype``) always take the torch path:
    the Triton kernels compute in fp32.
    """
    if dtype != torch.float64 and default_backend("head", device) == "triton":
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


def forced_backend() -> str:
    """The backend forced by ``MEMGRAD_BACKEND`` (``"torch"``, ``"triton"``), or ``""`` when it is unset."""
    return os.environ.get("MEMGRAD_BACKEND", "").strip().lower()


def default_backend(family: str, device: torch.device | str | None = None) -> str:
    """:func:`backend`, for the families whose Triton kernels are the default on a GPU (``"head"``, ``"forge"``,
    ``"titans"``'s row ops):
    ``"triton"`` only once a smoke test of that family has built and run on ``device``'s kind in this process. A
    default must not stop training where Triton cannot build for the GPU or driver: there one warning names the
    error and the torch path serves every call. A forced ``MEMGRAD_BACKEND=triton`` is not second-guessed."""
    forced = forced_backend()  # read once: this runs per layer and step (an environment read costs ~1-2 µs)
    chosen = backend(device, forced)
    if chosen != "triton" or forced == "triton":
        return chosen
    kind = _device_kind(device)
    if (family, kind) not in _TRITON_RUNS:
        try:
            with torch.no_grad(), torch.autocast(kind, enabled=False):  # whatever context the first call is in
                smoke.TESTS[family](kind)
            _TRITON_RUNS[family, kind] = True
        except Exception as e:  # any failure to build or launch: fall back, say why
            _TRITON_RUNS[family, kind] = False
            log.warning("memgrad_hf: the Triton %s kernels do not run on this %s (%s: %s); the torch path is used "
                        "instead (same results, slower). MEMGRAD_BACKEND=torch skips this check.", family, kind,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return "triton" if _TRITON_RUNS[family, kind] else "torch"


_TRITON_RUNS: dict[tuple[str, str], bool] = {}


def titans_step_impl(device: torch.device | str | None = None):
    """The Titans ``memory_step`` for tensors on ``device``: the torch manual kernel
    (:func:`memgrad_hf.kernels.titans.memory_step`) on every device, unless ``MEMGRAD_BACKEND=triton`` asks for the
    Triton twin (:func:`memgrad_hf.kernels.titans_triton.memory_step`, Triton forward, torch-twin backward).

    Measured on an H100 (benchmarks/RESULTS.md, 2026-11-22 and -27): the Triton twin, one program per memory, is
    slower than the torch kernel's batched cuBLAS GEMMs in training and at D=128, so it is opt-in here. Both have the
    same signature and return values. Imported lazily so CPU-only installs never import Triton. On a GPU the torch
    kernel runs its row ops (LayerNorm, loss gradient, LayerNorm backward) through
    :mod:`memgrad_hf.kernels.titans_rows_triton` by default (``default_backend("titans")``), and an inference step
    at head width <= 64 as the Triton twin's one kernel (faster there; measured 2026-11-27).
    """
    if backend(device) == "triton" and forced_backend() == "triton":
        from memgrad_hf.kernels.titans_triton import memory_step
    else:
        from memgrad_hf.kernels.titans import memory_step
    return memory_step
