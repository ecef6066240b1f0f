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


def _autograd_entropy(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(x @ w.T, -1)
    return -(lp.exp() * lp).sum(-1)


def _memgrad_entropy(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    from memgrad_hf.functional import linear_logprobs

    return linear_logprobs(x, w, t, return_entropy=True)[1]


def _entropy_hidden_grad(fn, h, w, t, dtype) -> torch.Tensor:
    x = h.to(dtype).clone().requires_grad_()
    (fn(x, w.to(dtype), t) * torch.linspace(0.5, 1.5, h.shape[0], dtype=dtype)).sum().backward()
    return x.grad.double()


def entropy_grad_errors(std: float = 40.0, seeds: tuple[int, ...] = (0, 1, 2)) -> tuple[float, float]:
    """Relative error, against fp64, of the hidden-state gradient of weighted per-token entropies at logits of standard
    deviation ~``std``, summed over ``seeds``: ``(memgrad's linear_logprobs in fp32, fp32 autograd through
    log_softmax)``. Large logits are where a formula that subtracts two numbers of the logits' size (e.g.
    ``lse - Σ p z``) loses digits."""
    ours = fp32 = 0.0
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(64, 32, dtype=torch.float64, generator=g)
        w = torch.randn(500, 32, dtype=torch.float64, generator=g) * std / 32**0.5
        t = torch.randint(0, 500, (64,), generator=g)
        ref = _entropy_hidden_grad(_autograd_entropy, h, w, t, torch.float64)
        ours += rel_err(_entropy_hidden_grad(_memgrad_entropy, h, w, t, torch.float32), ref)
        fp32 += rel_err(_entropy_hidden_grad(_autograd_entropy, h, w, t, torch.float32), ref)
    return ours, fp32
