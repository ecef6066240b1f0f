"""Swap the forward of ``nn.Linear`` and ``nn.Embedding`` layers for the FORGE one, and restore it: bookkeeping only."""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch
from torch import nn

from memgrad_hf.engine import REUSED_PER_FORWARD
from memgrad_hf.optim.fused_linear import ForgeEmbeddingFunction, ForgeLinearFunction

_ATTR = "_memgrad_forge"
_SAVED_FORWARD = "_memgrad_forge_hooked_forward"  # the forward accelerate's hook called before the swap


class OptimizerRef(weakref.ref):
    """A weak reference to a FORGE optimizer, kept on the model (its layers, hooks, forward wrapper): pickled, it
    is a dead one. ``torch.save(model)`` of a model being trained carries no optimizer (a plain weak reference
    cannot be pickled at all), and the loaded model runs its layers plainly."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return _dead_ref, ()


class _Gone:
    pass


_DEAD = weakref.ref(_Gone())  # (its referent is gone at once: calling it gives None)


def _dead_ref() -> weakref.ref:
    return _DEAD


_FP16_AUTOCAST = (
    "FORGE optimizers do not train under fp16 autocast: fp16 gradients need a GradScaler against underflow, and "
    "FORGE applies the update inside backward, before a scaler could unscale or skip it. Use bf16 autocast "
    "(torch.autocast(..., dtype=torch.bfloat16); no scaler needed), or torch.optim.AdamW with the scaler."
)


def _optimizer_of(module: nn.Module, weight: torch.Tensor | None) -> Any:
    """The FORGE optimizer that fused ``module`` (whose weight is ``weight``), or None where the layer runs as the
    plain module: in a deep copy of the model (an EMA, teacher or reference copy: its weight is not one the optimizer
    updates), for a weight that is no longer a parameter (pruned), or for a weight with a gradient hook."""
    ref = module.__dict__.get(_ATTR)  # a weakref: a deep copy of the model does not copy the optimizer and its state
    opt = None if ref is None else ref()
    # a gradient hook on the weight (Tensor.register_hook: masking rows, scaling) must see the whole gradient: the
    # layer runs as plain nn.Linear and the update comes from the hook path, after the user's hook
    if opt is None or weight is None or weight._backward_hooks or weight not in opt._fused:
        return None
    return opt


def _compiled_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer inside ``torch.compile``: one opaque operator the graph keeps (``memgrad::forge_linear``), where the
    eager path's autograd Function would break the graph; the operator checks at run time what the eager path checks
    here (see :mod:`memgrad_hf.optim.forge_ops`)."""
    params = self._parameters
    weight, bias = params.get("weight"), params.get("bias")
    if not torch.is_grad_enabled() or weight is None or not weight.requires_grad:
        return nn.Linear.forward(self, x)
    dev = x.device.type
    dt = None
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if dt == torch.float16:
            raise ValueError(_FP16_AUTOCAST)
    return torch.ops.memgrad.forge_linear(x, weight, bias, dt)


def _forge_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _compiled_forward(self, x)
    # runs once per layer and step: on a GPU at small batch the host's time per layer is the step's time (the
    # parameters are read from _parameters: nn.Module.__getattr__ costs ~0.6 µs a lookup)
    params = self._parameters
    weight, bias = params.get("weight"), params.get("bias")
    opt = _optimizer_of(self, weight)
    if opt is None:
        return nn.Linear.forward(self, x)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if dt == torch.float16 and torch.is_grad_enabled():
            raise ValueError(_FP16_AUTOCAST)
        with torch.autocast(dev, enabled=False):  # the Function casts itself; autocast would hand it a weight copy
            out = ForgeLinearFunction.apply(x, weight, bias, opt, dt)
    else:
        out = ForgeLinearFunction.apply(x, weight, bias, opt, None)
    if out.grad_fn is not None:
        opt._note_use(weight, out.grad_fn)
    elif opt._segment is not None:  # a reentrant checkpointed segment's first forward
        opt._note_segment_use(weight)
    return out


def _forge_embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    weight = self._parameters.get("weight")
    if torch.compiler.is_compiling():  # (see _compiled_forward)
        if not torch.is_grad_enabled() or weight is None or not weight.requires_grad:
            return nn.Embedding.forward(self, ids)
        return torch.ops.memgrad.forge_embedding(ids, weight, self.padding_idx)
    opt = _optimizer_of(self, weight)
    if opt is None:
        return nn.Embedding.forward(self, ids)
    out = ForgeEmbeddingFunction.apply(ids, weight, self.padding_idx, opt)
    if out.grad_fn is not None:
        opt._note_use(weight, out.grad_fn)
    elif opt._segment is not None:
        opt._note_segment_use(weight)
    return out


# A bound method pickles as getattr(its object, its function's __name__): named "forward", a swapped layer of a
# pickled model (torch.save(model) mid-training) loads with the class's forward (and a dead optimizer reference)
_forge_forward.__name__ = _forge_embedding_forward.__name__ = "forward"


def _plain_embedding(m: nn.Module) -> bool:
    # max_norm renormalizes rows in forward and sparse=True has its own gradient format: leave those alone
    return type(m) is nn.Embedding and m.max_norm is None and not m.sparse and not m.scale_grad_by_freq


def swap_layers(model: nn.Module, optimizer: Any, weights: set[int]) -> list[nn.Module]:
    """Give every plain ``nn.Linear`` (and ``nn.Embedding``) whose weight (by ``id``) is in ``weights`` the fused
    backward."""
    swapped = []
    for module in model.modules():
        if type(module) is nn.Linear:
            fwd = _forge_forward
        elif _plain_embedding(module):
            fwd = _forge_embedding_forward
        else:
            continue
        if id(module.weight) not in weights or getattr(module, REUSED_PER_FORWARD, False):
            continue
        hooked = _accelerate_hooked(module)
        own = module.__dict__.get("forward")
        # (a forward of the module's class bound to it is what accelerate's remove_hook_from_module leaves behind)
        if own is not None and not hasattr(module, _ATTR) and not hooked and not _class_forward(module, own):
            continue  # someone else (e.g. the chunked head capture) owns this forward right now
        setattr(module, _ATTR, OptimizerRef(optimizer))
        if hooked:
            # accelerate's hook (device placement under a device_map) calls module._old_forward between its pre- and
            # post-forward: the fused forward goes there, inside the hook, which stays
            module.__dict__.setdefault(_SAVED_FORWARD, module.__dict__["_old_forward"])
            module._old_forward = types.MethodType(fwd, module)
        else:
            module.forward = types.MethodType(fwd, module)
        swapped.append(module)
    return swapped


def _class_forward(module: nn.Module, fwd: Any) -> bool:
    return getattr(fwd, "__func__", None) is type(module).forward and getattr(fwd, "__self__", None) is module


def _ours(fwd: Any) -> bool:
    return getattr(fwd, "__func__", None) in (_forge_forward, _forge_embedding_forward)


def _accelerate_hooked(module: nn.Module) -> bool:
    """Whether accelerate's ``add_hook_to_module`` wraps ``module.forward`` (its forward kept as ``_old_forward``)."""
    return "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__


def restore_layers(modules: list[nn.Module]) -> None:
    """Give the layers :func:`swap_layers` returned their own forward back."""
    for module in modules:
        if hasattr(module, _ATTR):
            delattr(module, _ATTR)
            saved = module.__dict__.pop(_SAVED_FORWARD, None)
            # under an accelerate hook (added before the swap, or after it: then it wraps ours) ours is its inner
            # forward: the one before it goes back there, the hook stays
            if _ours(module.__dict__.get("_old_forward")):
                module._old_forward = saved if saved is not None else types.MethodType(type(module).forward, module)
            if _ours(module.__dict__.get("forward")):  # (ours, or a hook removed since put ours back as the forward)
                del module.__dict__["forward"]
