"""FORGE's linear layer as two custom operators, for models run under ``torch.compile``.

Eager training runs :class:`~memgrad_hf.optim.fused_linear.ForgeLinearFunction`, whose context holds the optimizer:
dynamo cannot trace that (nor the optimizer's bookkeeping in its backward), so a compiled model broke its graph at
every fused layer (a 2-layer tiny Llama: 20 graphs). Under compilation the layer calls ``memgrad::forge_linear``
instead, an opaque operator the compiled graph keeps: its forward is the layer's GEMM, and its backward calls
``memgrad::forge_linear_backward``, which computes ``dX`` with the old weight and then runs the same fused update as
the eager path (:func:`~memgrad_hf.optim.fused_linear.linear_backward`). The backward operator is registered as
having ordered side effects, so the compiler neither drops it (the first layer's ``dX`` is often unused) nor moves
it. The operators take no optimizer: one is found at run time as the live FORGE optimizer that updates the weight
passed in (:func:`register`), so the compiled graph is the same whichever optimizer trains the model (a second
``Trainer`` on the same model, another optimizer's configuration) and inductor's graph cache serves it again.

The operators count each fused weight's uses not yet back-propagated (the eager path keeps the layer's autograd
node instead), so that a weight used twice before one backward (a layer called twice, two forwards and one loss) is
found and its parts summed before one update, as in eager mode.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.library import EffectType, Library, register_autograd, register_fake

from memgrad_hf.errors import UnsupportedModelError
from memgrad_hf.optim.fused_linear import embedding_backward, linear_backward, linear_forward

_OPTIMIZERS: dict[int, weakref.ref] = {}  # the live FORGE optimizers, in the order they were created
_KEYS = itertools.count()
# Defined through torch.library.Library rather than @custom_op: each call of a @custom_op runs ~6 µs more Python
# (its input checks and wrappers; 9.0 against 2.9 µs per call on this CPU), and a compiled step calls two per fused
# layer, where a GPU's step at batch 1 waits on the host
_LIB = Library("memgrad", "FRAGMENT")


def _define(schema: str, impl: Any, fake: Any) -> Any:
    """Define ``memgrad::<schema>`` with one implementation for every device and its fake (shape) twin."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    register_fake(f"memgrad::{name}", fake, lib=_LIB)
    return getattr(torch.ops.memgrad, name).default


def register(opt: Any) -> None:
    """Make ``opt`` findable by the operators, for as long as it lives (a weak reference)."""
    key = next(_KEYS)
    _OPTIMIZERS[key] = weakref.ref(opt, lambda _, k=key: _OPTIMIZERS.pop(k, None))


def _owner(weight: Tensor) -> Any:
    """The FORGE optimizer that updates ``weight`` (the newest, as the layer's eager forward takes the optimizer that
    swapped it last), or None: a deep copy's weight (an EMA or reference copy of the model), or an optimizer deleted
    or detached since. Such a layer back-propagates plainly into ``.grad``, as ``nn.Linear`` would."""
    for ref in reversed(list(_OPTIMIZERS.values())):
        opt = ref()
        if opt is not None and weight in opt._fused:
            return opt
    return None


def _note_use(weight: Tensor) -> None:
    """A forward operator's use of ``weight``, counted by its optimizer (none: a deep copy's weight). A weight that
    is not a parameter here was replaced inside the compiled graph: the model changes the weight's ``.data`` in its
    forward (Gemma 3n's AltUp clamps ``prediction_coefs.weight.data``), which compilation turns into a new tensor.
    The parameter cannot be found from it, and its gradient would be lost: refused."""
    opt = _owner(weight)
    if opt is not None:
        opt._note_compiled_use(weight)
    elif not isinstance(weight, torch.nn.Parameter):
        raise UnsupportedModelError(
            f"memgrad_hf: a FORGE layer (weight of shape {tuple(weight.shape)}) received its weight under "
            "torch.compile as a tensor computed in the compiled graph, not as the parameter: the model changes the "
            "weight's .data in its forward (as Gemma 3n's AltUp clamps prediction_coefs.weight.data), which "
            "compilation turns into a new tensor. FORGE cannot update the parameter from there. Train this model "
            "uncompiled with FORGE (torch_compile=False), or compiled with a torch optimizer.")


def _forge_linear(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype | None) -> Tensor:
    """``F.linear(x, weight, bias)`` in ``dtype`` (None: the weight's)."""
    # (the op casts itself, as the eager Function does; the first check is one C call, the second builds a device)
    if torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            out, _, _ = linear_forward(x, weight, bias, dtype)
    else:
        out, _, _ = linear_forward(x, weight, bias, dtype)
    _note_use(weight)
    return out


def _forge_linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=dtype or weight.dtype)


forge_linear = _define("forge_linear(Tensor x, Tensor weight, Tensor? bias, ScalarType? dtype) -> Tensor",
                       _forge_linear, _forge_linear_fake)


def _forge_linear_backward(dy: Tensor, x: Tensor, weight: Tensor, dtype: torch.dtype | None, need_dx: bool,
                           bias_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """``(dX, db)`` (an empty tensor for what is not needed) after the fused update of ``weight``."""
    opt, dt = _owner(weight), dtype or weight.dtype
    fused = _begin_backward(opt, weight)
    xc = x if x.dtype == dt else x.to(dt)
    _borrow(opt, True)
    try:
        dx, dw, db = linear_backward(opt, dy, xc, weight, bias_dtype, dt, need_dx, True,
                                     (lambda: _accumulates(weight, opt)) if fused else (lambda: False))
    finally:
        _borrow(opt, False)
    if dw is not None:
        _weight_grad(opt, weight, dw, fused)
    if dx is not None and dx.dtype != x.dtype:
        dx = dx.to(x.dtype)
    # (an operator's outputs may not alias each other: one empty tensor per absent result)
    return (dy.new_empty(0) if dx is None else dx), (dy.new_empty(0) if db is None else db)


def _forge_linear_backward_fake(dy: Tensor, x: Tensor, weight: Tensor, dtype: torch.dtype | None, need_dx: bool,
                                bias_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    dx = x.new_empty(x.shape) if need_dx else dy.new_empty(0)
    db = dy.new_empty(weight.shape[0], dtype=bias_dtype) if bias_dtype is not None else dy.new_empty(0)
    return dx, db


forge_linear_backward = _define(
    "forge_linear_backward(Tensor dy, Tensor x, Tensor weight, ScalarType? dtype, bool need_dx, "
    "ScalarType? bias_dtype) -> (Tensor, Tensor)", _forge_linear_backward, _forge_linear_backward_fake)
# side effects (the weight and optimizer state change): the compiler must keep the call, in order
torch.library._register_effectful_op(forge_linear_backward, EffectType.ORDERED)


def _forge_embedding(ids: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
    """``F.embedding(ids, weight, padding_idx)``: the embedding counterpart of ``forge_linear``."""
    out = torch.nn.functional.embedding(ids, weight, padding_idx)
    _note_use(weight)
    return out


def _forge_embedding_fake(ids: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
    return weight.new_empty(*ids.shape, weight.shape[1])


forge_embedding = _define("forge_embedding(Tensor ids, Tensor weight, int? padding_idx) -> Tensor",
                          _forge_embedding, _forge_embedding_fake)


def _forge_embedding_backward(dy: Tensor, ids: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
    """The fused update of an embedding's ``weight``; returns an empty tensor (the operator's effect is the update)."""
    opt = _owner(weight)
    fused = _begin_backward(opt, weight)
    _borrow(opt, True)
    try:
        dw = embedding_backward(opt, dy, ids, weight, padding_idx,
                                (lambda: _accumulates(weight, opt)) if fused else (lambda: False))
    finally:
        _borrow(opt, False)
    if dw is not None:
        _weight_grad(opt, weight, dw, fused)
    return dy.new_empty(0)


forge_embedding_backward = _define(
    "forge_embedding_backward(Tensor dy, Tensor ids, Tensor weight, int? padding_idx) -> Tensor",
    _forge_embedding_backward, lambda dy, ids, weight, padding_idx: dy.new_empty(0))


torch.library._register_effectful_op(forge_embedding_backward, EffectType.ORDERED)


def _setup_embedding(ctx: Any, inputs: tuple, output: tuple) -> None:
    ids, weight, padding_idx = inputs
    ctx.save_for_backward(ids, weight)
    ctx.padding_idx = padding_idx


def _backward_embedding(ctx: Any, dout: Tensor) -> tuple:
    ids, weight = ctx.saved_tensors
    forge_embedding_backward(dout, ids, weight, ctx.padding_idx)
    return None, None, None


register_autograd("memgrad::forge_embedding", _backward_embedding, setup_context=_setup_embedding, lib=_LIB)


def _borrow(opt: Any, on: bool) -> None:
    """Set while an operator runs the update: what it records for a later replay (exact clipping's norm pass) must be
    copied, the graph reusing its buffers once the operator returns (a replay read another tensor's values). (A flag
    set and reset around the call: a context manager costs ~1.5 µs per layer and step.)"""
    if opt is not None:
        opt._borrowed_inputs = on


def _begin_backward(opt: Any, weight: Tensor) -> bool:
    """Whether ``opt`` (:func:`_owner`) updates ``weight`` in this backward operator; False where no optimizer
    does (a deep copy of the model): that layer back-propagates plainly (its gradient is returned, and goes into
    ``.grad``, as ``nn.Linear``'s would)."""
    if opt is None:
        return False
    opt._compiled_use_done(weight)
    # dynamo does not see a parameter's hooks when it traces the layer: checked here, at run time, before torch runs
    # the hook on the weight's gradient, which the compiled graph leaves undefined
    if weight._backward_hooks:
        raise RuntimeError(
            "memgrad_hf: a gradient hook (Tensor.register_hook) on a weight that FORGE updates inside backward is not "
            "supported under torch.compile: the compiled graph hands the hook no gradient. Run the model uncompiled "
            "(the eager FORGE layer runs such a weight's layer plainly and applies the hooked gradient), or remove "
            "the hook.")
    return True


def _weight_grad(opt: Any, weight: Tensor, dw: Tensor, fused: bool) -> None:
    """A weight gradient the backward operator did not apply: for a weight ``opt`` fuses (its gradient has other
    parts), into ``.grad`` and applied when the backward ends; else into ``.grad``, as autograd would put it."""
    if not fused:
        weight.grad = dw if weight.grad is None else weight.grad + dw
        return
    if not _accumulates(weight, opt):
        raise RuntimeError(
            "memgrad_hf: torch.autograd.grad (or backward(inputs=...) without the weights) through a FORGE layer of a "
            "compiled model is not supported: the compiled graph cannot return the weight gradient. Run that model "
            "uncompiled, or detach the optimizer (optimizer.detach()) for that computation.")
    opt._compiled_weight_grad(weight, dw)


def _accumulates(weight: Tensor, opt: Any) -> bool:
    """Whether the running backward accumulates into ``weight`` (false under ``torch.autograd.grad``). Its gradient
    accumulator was found when the optimizer attached (an operator runs below autograd: no view gets a node here)."""
    node = opt._grad_nodes.get(weight)
    if node is None:
        return True
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return False


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, dtype = inputs
    ctx.save_for_backward(x, weight)
    ctx.dtype = dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx: Any, dout: Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    need_dx, need_db = ctx.needs_input_grad[0], ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    dx, db = forge_linear_backward(dout, x, weight, ctx.dtype, need_dx, ctx.bias_dtype if need_db else None)
    return (dx if need_dx else None), None, (db if need_db else None), None


register_autograd("memgrad::forge_linear", _backward, setup_context=_setup, lib=_LIB)
