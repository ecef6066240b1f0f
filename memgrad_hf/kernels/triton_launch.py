"""Launching a Triton kernel without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds, types and specializes every argument in Python on each call, then looks
the compiled variant up: ~15 µs for FORGE's 54-argument kernel on a 2-core x86 CPU (Triton 3.6 and 3.9), where the
variant it returns launches in ~2 µs (``CompiledKernel[grid](*args)``, Triton's own entry point). On a GPU at batch
1 the host's time per launch is the step's time, and FORGE launches once per linear layer.

:class:`Launcher` keeps each variant Triton returned under a key that fixes everything Triton specializes on (each
tensor's dtype and address mod 16, where Triton asks whether it is 16-byte aligned; each int's value, where Triton
asks whether it is 1, divisible by 16 and fits 32 bits, or only its width for ``do_not_specialize`` ones; the type of
every float and bool; the constexprs, ``num_warps``, ``num_stages`` and the device) and launches it directly when the
key comes again. The key is finer than Triton's: a new key costs one lookup through Triton, and a variant is never
launched for arguments it was not compiled for. A new key, the interpreter (``TRITON_INTERPRET=1``), a Triton version
whose rules were not checked (:data:`CHECKED`) and ``MEMGRAD_TRITON_LAUNCH=jit`` (read at import) go through
``kernel[grid]`` as usual. ``tests/test_triton_launch.py`` checks the variants and the launched arguments against
Triton's own binder on CPU.
"""

from __future__ import annotations

import functools
import operator
import os
from typing import Any

import torch
import triton
from triton.runtime.driver import driver

# Triton versions whose specialization rules the key was checked against (tests/test_triton_launch.py)
CHECKED = ((3, 5), (3, 9))  # (run: 3.5.1, 3.6.0, 3.7.1, 3.8.0, 3.9.0)


@functools.lru_cache(maxsize=4)
def _version_checked(version: str) -> bool:
    try:
        v = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return CHECKED[0] <= v <= CHECKED[1]


# read once, as Triton reads TRITON_INTERPRET once (when it decorates the kernels); tests set it directly
ENABLED = os.environ.get("MEMGRAD_TRITON_LAUNCH", "").strip() != "jit" and _version_checked(triton.__version__)
_MAX_KEYS = 4096  # (variable token counts make new keys: the table is emptied past this)


def _picker(idx: list[int]) -> Any:
    """A function returning ``args[i] for i in idx`` as a tuple (itemgetter's speed, any length)."""
    if len(idx) > 1:
        return operator.itemgetter(*idx)
    return (lambda args: (args[idx[0]],)) if idx else (lambda args: ())


def _layout(types: tuple, unspecialized: frozenset[int]) -> tuple | None:
    """Where the tensors, the ints Triton specializes and those it does not (``unspecialized``: their width only)
    are among arguments of these types; None if a type's specialization is not known here (then Triton binds the
    call)."""
    tensors, ints, wide = [], [], []
    for i, t in enumerate(types):
        if issubclass(t, torch.Tensor):
            tensors.append(i)
        elif t is int:
            (wide if i in unspecialized else ints).append(i)
        elif t not in (float, bool):  # (Triton types these without looking at the value)
            return None
    return _picker(tensors), _picker(ints), _picker(wide)


def _width(v: int) -> int:
    """Triton's type for an int it does not specialize: 0 i32, 1 i64, 2 u64."""
    return (v >= 1 << 31 or v < -(1 << 31)) + (v >= 1 << 63)


class Launcher:
    """``launcher(grid, *args, num_warps=..., num_stages=..., **constexprs)`` does what ``fn[grid](*args,
    num_warps=..., num_stages=..., **constexprs)`` does, with Triton's binding skipped for a variant already launched
    once. ``args``: every runtime argument, positionally, in the kernel's order; the constexprs by name (defaults
    filled in), all of which follow the runtime arguments in the kernel's signature.

    Example::

        _launch = Launcher(my_kernel)
        _launch((blocks,), x, y, n, BLOCK=1024, num_warps=4, num_stages=1)
    """

    def __init__(self, fn: Any):
        self.fn = fn
        params = getattr(fn, "params", [])  # (none under the interpreter, which launches through fn[grid] anyway)
        first_const = next((i for i, p in enumerate(params) if p.is_constexpr), len(params))
        # (the direct launch passes the constexprs after the runtime arguments, as Triton's binder orders them)
        self._trailing = bool(params) and all(p.is_constexpr for p in params[first_const:])
        self._consts = tuple((p.name, p.default) for p in params[first_const:])
        self._unspecialized = frozenset(i for i, p in enumerate(params[:first_const]) if p.do_not_specialize)
        self._kernels: dict[tuple, Any] = {}
        self._layouts: dict[tuple, tuple | None] = {}
        self.direct = 0  # launches that skipped Triton's binding (tests read it)

    def __call__(self, grid: tuple, *args: Any, num_warps: int, num_stages: int, **consts: Any) -> None:
        types = tuple(map(type, args))
        layout = self._layouts.get(types, False)
        if layout is False:
            layout = self._layouts[types] = _layout(types, self._unspecialized)
        if not (self._trailing and ENABLED and layout is not None):
            self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **consts)
            return
        cvals = tuple([consts[n] if n in consts else d for n, d in self._consts])
        # tensors by dtype and address mod 16 (Triton: aligned to 16 bytes or not); ints by value (Triton: == 1,
        # divisible by 16, width), those Triton does not specialize (noise keys, offsets) by width
        tensors, ints, wide = layout
        key = (driver.active.get_current_device(), num_warps, num_stages, cvals, types,
               tuple([(t.dtype, t.data_ptr() & 15) for t in tensors(args)]), ints(args),
               tuple([_width(v) for v in wide(args)]))
        kernel = self._kernels.get(key)
        if kernel is not None:
            kernel[(grid + (1, 1))[:3]](*args, *cvals)
            self.direct += 1
            return
        kernel = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **consts)
        if isinstance(kernel, triton.compiler.CompiledKernel):
            if len(self._kernels) >= _MAX_KEYS:
                self._kernels.clear()
            self._kernels[key] = kernel
