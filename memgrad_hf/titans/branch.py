"""``GatedMemoryBranch``: the module that Titans injection attaches to a decoder layer (``layer.titans_memory``).

The patched layer returns ``layer(x) + sigmoid(W_g x) * W_o NeuralMemory(x)`` (Titans' gated variant, MAG), with
``x`` the layer's input hidden states. ``W_o`` starts at zero, so a freshly patched model computes exactly what the
original computes; the first optimizer step moves ``W_o`` and from then on every memory parameter gets gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from memgrad_hf.titans.memory import NeuralMemory, NeuralMemState


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
        h = x
        if x.dtype != self.gate.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            # a residual stream kept in another dtype than the weights (mamba's residual_in_fp32 in a bf16 model):
            # the branch runs in its parameters' dtype and hands its delta back in the stream's
            h = x.to(self.gate.weight.dtype)
        retrieved, state = self.memory(h, state, mask)
        return (torch.sigmoid(self.gate(h)) * self.out(retrieved)).to(x.dtype), state
