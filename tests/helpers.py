"""Shared test utilities."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def enable_checkpointing(model: torch.nn.Module, use_reentrant: bool = False) -> None:
    """Activation checkpointing under the name of the installed transformers (``activation_checkpointing_enable``
    since 5.24; ``gradient_checkpointing_enable`` is deprecated there and goes in v6)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / max |b| (0 when both are 0)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff if denom == 0 else diff / denom


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.numel() > self.max_numel:
                self.max_numel, self.op = o.numel(), func
        return out
