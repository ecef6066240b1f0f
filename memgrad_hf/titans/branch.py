"""``GatedMemoryBranch``: the module that Titans injection attaches to a decoder layer (``layer.titans_memory``).

The patched layer returns ``layer(x) + sigmoid(W_g x) * W_o NeuralMemory(x)`` (Titans' gated variant, MAG), with
``x`` the layer's input hidden states. ``W_o`` starts at zero, so a freshly patched model computes exactly what the
original computes; the first optimizer step moves ``W_o`` and from then on every memory parameter gets gradients.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from memgrad_hf.titans.memory import NeuralMemory, NeuralMemState

logger = logging.getLogger(__name__)


def _warn_if_inert(branch: GatedMemoryBranch) -> None:
    """A frozen ``W_o`` still at its zero start makes the branch add nothing while it costs its compute: what PEFT
    leaves when the memory is not in ``modules_to_save``. Checked once per branch, at its first training forward."""
    branch._inert_checked = True
    if not branch.out.weight.requires_grad and not bool(branch.out.weight.any()):
        logger.warning(
            "Titans memory: this branch is frozen with its output projection still zero, so it adds nothing to the "
            "model. PEFT freezes modules outside its adapters: pass LoraConfig(modules_to_save=['titans_memory']) "
            "(or set requires_grad on the memory's parameters) to train it.")


class GatedMemoryBranch(nn.Module):
    """``sigmoid(gate(x)) * out(NeuralMemory(x))``, with ``out`` (``W_o``) zero-initialised.

    Args:
        dim: the decoder's hidden size.
        **memory_kwargs: passed to :class:`~memgrad_hf.titans.NeuralMemory` (e.g. ``TitansConfig.memory_kwargs()``).

    ``forward(x, state=None, mask=None) -> (delta, state)``: ``delta`` has the shape of ``x`` and is added to the
    layer's output; ``mask`` ``(batch, tokens)`` is the memory's store mask (0 = padding).

    Example::

        branch = GatedMemoryBranch(512, heads=4, chunk_size=64)
        delta, state = branch(x)            # delta == 0 until ``branch.out`` is trained
    """

    def __init__(self, dim: int, **memory_kwargs: Any) -> None:
        super().__init__()
        self.memory = NeuralMemory(dim, **memory_kwargs)
        self.gate = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim, bias=False)
        nn.init.zeros_(self.out.weight)

    def forward(self, x: Tensor, state: NeuralMemState | None = None, mask: Tensor | None = None,
                ) -> tuple[Tensor, NeuralMemState]:
        if self.training and torch.is_grad_enabled() and not getattr(self, "_inert_checked", False) \
                and not torch.compiler.is_compiling():
            _warn_if_inert(self)
        h = x
        if x.dtype != self.gate.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            # a residual stream kept in another dtype than the weights (mamba's residual_in_fp32 in a bf16 model):
            # the branch runs in its parameters' dtype and hands its delta back in the stream's
            h = x.to(self.gate.weight.dtype)
        retrieved, state = self.memory(h, state, mask)
        return (torch.sigmoid(self.gate(h)) * self.out(retrieved)).to(x.dtype), state
