"""What a model call says about its tokens, read for the Titans memory: padding (never stored) and packed-document
starts (the memory restarts). A forward pre-hook on the module holding the decoder layers (the backbone, so that
calls to it alone are served too) reads the call's ``attention_mask`` and ``position_ids`` into a :class:`StoreMask`
shared with the patched layers; a forward hook clears it.

The mask may come in three forms, all handled:

- 2-D ``(B, past + T)`` ones and zeros, as users and collators pass it;
- 4-D ``(B, 1, T, keys)`` boolean or additive, as ``generate`` builds it for a static cache and as packing collators
  pass it: token ``i`` is real iff it may attend to itself (key column ``past + i``), and starts a document iff it
  may not attend to the real token before it;
- a dict of 4-D masks by layer type (models with ``layer_types``): the full-attention one is read.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")  # "cache": transformers >= 5.24


@dataclass
class StoreMask:
    """What the model call in flight says about its tokens, shared by the model's hooks and its patched layers:
    the padding mask, and where packed documents start (as transformers finds them from ``position_ids``)."""

    mask: Tensor | None = None  # (B, past + T) or (B, T), 1/True = a real token; None when every token is real
    starts: Tensor | None = None  # (B or 1, T) bool: a document starts here; None when no row holds two
    left_pad_warned: bool = False
    uncovered_warned: bool = False  # a 4-D mask padding could not be read from (said once)


def document_starts(position_ids: Any) -> Tensor | None:
    """Where packed documents start: ``position_ids`` not one more than the previous one (transformers' own rule,
    ``masking_utils.find_packed_sequence_indices``); None unless some row holds more than one document."""
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return None
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts if bool(starts[:, 1:].any()) else None


def masks_from_4d(mask: Tensor, past: int) -> tuple[Tensor | None, Tensor | None] | None:
    """``(padding mask (B, T), document starts (B, T))`` of the ``T`` query tokens of a 4-D attention mask
    ``(B, 1 or heads, T, keys)`` whose key columns are cache positions (``past`` tokens already cached); each None
    when it says nothing (no padding; one document per row). None when the mask does not reach the tokens' own key
    columns (e.g. a sliding-window buffer), so it cannot be read."""
    t = mask.shape[-2]
    if past + t > mask.shape[-1]:
        return None
    rows = torch.arange(t, device=mask.device)
    m = mask[:, 0]
    visible = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2  # additive: 0 (or a bias) / min
    real = visible[:, rows, past + rows]
    if t < 2:
        return (None if bool(real.all()) else real), None
    # a real token starts a document iff it may not attend to the real token before it (pads skipped: a padded row
    # of packed documents still separates them); the first real token of a row continues what the row began, as
    # on the 2-D mask path (left padding is not a document boundary)
    idx = rows.expand_as(real)
    prev = torch.cummax(torch.where(real, idx, -1), 1).values  # the last real token at or before i
    prev = torch.cat([prev.new_full((prev.shape[0], 1), -1), prev[:, :-1]], 1)
    sees_prev = visible.gather(2, (past + prev.clamp(min=0)).unsqueeze(2)).squeeze(2)
    starts = real & (prev >= 0) & ~sees_prev
    starts[:, 0] = True
    return (None if bool(real.all()) else real), (starts if bool(starts[:, 1:].any()) else None)


def _past_length(cache: Any) -> int:
    if cache is None or not callable(getattr(cache, "get_seq_length", None)):
        return 0
    return int(cache.get_seq_length())


def install_mask_hooks(model: nn.Module, holder_of: Callable[[nn.Module], StoreMask]) -> tuple[int, ...]:
    """Hooks that hand each model call's padding mask (None when it has no zero: the unmasked memory path then
    runs) and its packed-document starts to the memory branches; one host sync per model call. ``holder_of(model)``
    finds the shared :class:`StoreMask` through the model the hook runs on, so a deep copy uses its own."""
    hooks = _MaskHooks(model, holder_of)
    pre = model.register_forward_pre_hook(hooks.grab, with_kwargs=True)
    post = model.register_forward_hook(hooks.release, with_kwargs=True, always_call=True)
    return pre.id, post.id


class _MaskHooks:
    """The two hooks of :func:`install_mask_hooks`, methods of an object rather than closures so that a pickled model
    (``torch.save(model)``) keeps them. ``holder_of`` must be a module-level function."""

    def __init__(self, model: nn.Module, holder_of: Callable[[nn.Module], StoreMask]) -> None:
        try:
            self.params = [p.name for p in inspect.signature(model.forward).parameters.values()]
        except (TypeError, ValueError):
            self.params = []
        self.holder_of = holder_of

    def arg(self, args: tuple, kwargs: dict, name: str) -> Any:
        params = self.params
        if kwargs.get(name) is not None or name not in params or len(args) <= params.index(name):
            return kwargs.get(name)
        return args[params.index(name)]

    def grab(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        holder = self.holder_of(module)
        m = self.arg(args, kwargs, "attention_mask")
        if isinstance(m, dict):
            m = m.get("full_attention", next((v for v in m.values() if isinstance(v, Tensor)), None))
        holder.mask = holder.starts = None
        if isinstance(m, Tensor) and m.dim() == 4:
            cache = next((c for c in (self.arg(args, kwargs, n) for n in CACHE_NAMES) if c is not None), None)
            past = _past_length(cache)
            read = masks_from_4d(m, past)
            # (one token after a cache, generate's decode step, is a generated token, never padding: nothing to say)
            if read is None and not (m.shape[-2] == 1 and past > 0) and not holder.uncovered_warned:
                holder.uncovered_warned = True
                logger.warning(
                    "Titans memory: the 4-D attention mask (%s) does not cover the tokens' own positions, so padding "
                    "cannot be read from it and every token is stored; pass a 2-D attention_mask (or use a dynamic "
                    "cache in generate) to keep padding out of the memory.", tuple(m.shape),
                )
            if read is not None:
                holder.mask, holder.starts = read
            return
        if isinstance(m, Tensor) and m.dim() == 2 and not bool(m.all()):
            holder.mask = m
            if module.training and torch.is_grad_enabled() and not holder.left_pad_warned and not bool(m[:, 0].all()):
                holder.left_pad_warned = True
                logger.warning(
                    "Titans memory: a training batch is left-padded. Pads never reach the memory, but they shift each "
                    "row's chunk boundaries (unless the padding is a multiple of chunk_size), so a row trains "
                    "differently from the same row unpadded. Pad on the right for training "
                    "(tokenizer.padding_side = 'right'): then the rows equal their unpadded runs."
                )
        # transformers separates packed documents only without an attention mask (and without a cache: the
        # layers check that), so the memory resets exactly where attention does
        if m is None:
            holder.starts = document_starts(self.arg(args, kwargs, "position_ids"))

    def release(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        holder = self.holder_of(module)
        holder.mask = holder.starts = None


def remove_hooks(model: nn.Module, ids: tuple[int, ...]) -> None:
    for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        table = getattr(model, name, None)
        if isinstance(table, dict):
            for i in ids:
                table.pop(i, None)
