"""Triton's launch path on a machine without a GPU: a stand-in driver and compiled kernels that record their launches.

Everything Triton does in Python for ``kernel[grid](...)`` runs for real (binding, specialization, its variant
cache); only compiling (no GPU to compile for) and the C launch are replaced. Used by ``_triton_launch_check.py``
(does :class:`memgrad_hf.kernels.triton_launch.Launcher` launch what Triton would?) and
``benchmarks.triton_launch_host`` (what each costs in Python). Import before the kernels, with
``TRITON_INTERPRET`` unset, in a process of its own (the stand-in driver stays active).
"""

from __future__ import annotations

import os
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("fake_triton_driver needs Triton's compiled-kernel path: unset TRITON_INTERPRET")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _Driver:
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class RecordingKernel(CompiledKernel):
    """A compiled variant whose launch records ``(variant, arguments)`` in :data:`LAUNCHES`."""

    def __init__(self, key: str):  # noqa: D107 (nothing of CompiledKernel's own state is needed)
        self.module, self.function, self._module_pid, self.packed_metadata = 1, 0, None, ()
        self.key, self.name, self.src = key, "recording", None

    def run(self, *launch: Any) -> None:
        LAUNCHES.append((self, launch[9:]))  # (grid x3, stream, function, metadata, launch metadata, two hooks)

    def __del__(self) -> None:
        pass


LAUNCHES: list[tuple[RecordingKernel, tuple]] = []
VARIANTS: list[RecordingKernel] = []


def _compile(self: JITFunction, key: str, signature: Any, device: int, *rest: Any, **kw: Any) -> RecordingKernel:
    kernel = RecordingKernel(key)
    VARIANTS.append(kernel)
    self.device_caches[device][0][key] = kernel
    return kernel


def install() -> None:
    """Make the stand-in driver active and every ``@triton.jit`` kernel "compile" to a :class:`RecordingKernel`."""
    driver.set_active(_Driver())
    JITFunction._do_compile = _compile
