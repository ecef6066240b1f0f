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
    warned = getattr(branch, "_inert_warned", None)  # shared by the branches of one injection: one line per model
    if warned and warned[0]:
        return
    if not branch.out.weight.requires_grad and not bool(branch.out.weight.any()):
        if warned:
            warned[0] = True
        logger.warning(
            "Titans memory: a memory branch is frozen with its output projection still zero, so it adds nothing to "
            "the model (logged once per model). PEFT freezes modules outside its adapters: pass "
            "LoraConfig(modules_to_save=['titans_memory']) (or set requires_grad on the memory's parameters) to "
            "train it.")


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


def run_packed_documents(branch: nn.Module, x: Tensor, starts: Tensor, mask: Tensor | None = None) -> Tensor:
    """The branch over packed rows, each document from the initial memory: documents are gathered into a
    right-padded batch ``(documents, longest, D)`` with a store mask, run in one call, and scattered back. ``mask``
    (B, T): the rows' own padding (a pad belongs to the document before it and is never stored). ``branch``: a
    :class:`GatedMemoryBranch`, or PEFT's wrapper of one (called, so that the wrapper picks the adapter's copy).

    Example::

        starts = torch.tensor([[True, False, False, True, False]])   # two documents packed in one row
        delta = run_packed_documents(layer.titans_memory, x, starts)   # (1, 5, D); the second restarts the memory
    """
    b, t, d = x.shape
    doc = starts.long().cumsum(1) - 1  # document index within its row
    per_row = doc[:, -1] + 1
    first = torch.cumsum(per_row, 0) - per_row
    idx = torch.arange(t, device=x.device).expand(b, t)
    offset = idx - torch.cummax(torch.where(starts, idx, 0), 1).values  # position within its document
    n_docs, longest = int(per_row.sum()), int(offset.max()) + 1  # host syncs: the batch shape
    slot = ((doc + first[:, None]) * longest + offset).reshape(-1)
    xs = x.new_zeros(n_docs * longest, d).index_copy(0, slot, x.reshape(-1, d))
    keep = x.new_zeros(n_docs * longest)
    keep = keep.index_fill_(0, slot, 1.0) if mask is None else keep.index_copy_(0, slot, mask.reshape(-1).to(x.dtype))
    delta, _ = branch(xs.view(n_docs, longest, d), None, keep.view(n_docs, longest))
    return delta.reshape(-1, d).index_select(0, slot).view(b, t, d)
