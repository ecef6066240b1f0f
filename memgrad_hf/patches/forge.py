"""Swap the forward of ``nn.Linear`` layers for the FORGE one, and restore it: bookkeeping only."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

_ATTR = "_memgrad_forge"


def _forge_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    from memgrad_hf.optim.fused_linear import ForgeLinearFunction

    opt = getattr(self, _ATTR)
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    with torch.autocast(dev, enabled=False):  # the Function casts itself; autocast would hand it a weight copy
        return ForgeLinearFunction.apply(x, self.weight, self.bias, opt, dt)


def swap_linears(model: nn.Module, optimizer: Any, weights: set[int]) -> list[nn.Linear]:
    """Give every plain ``nn.Linear`` whose weight (by ``id``) is in ``weights`` the fused backward."""
    swapped = []
    for module in model.modules():
        if type(module) is not nn.Linear or id(module.weight) not in weights:
            continue
        if "forward" in module.__dict__ and not hasattr(module, _ATTR):
            continue  # someone else (e.g. the chunked head capture) owns this forward right now
        setattr(module, _ATTR, optimizer)
        module.forward = types.MethodType(_forge_forward, module)
        swapped.append(module)
    return swapped


def restore_linears(modules: list[nn.Linear]) -> None:
    for module in modules:
        if hasattr(module, _ATTR):
            delattr(module, _ATTR)
            module.__dict__.pop("forward", None)
