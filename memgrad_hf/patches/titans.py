"""Titans injection: a gated neural-memory branch on chosen decoder layers of any transformers decoder.

How it works (no decoder layer is replaced, so the original weights keep their ``state_dict`` keys):

1. The decoder-layer list is found generically (:func:`find_decoder_layers`).
2. Each chosen layer gets a submodule ``layer.titans_memory`` (a :class:`~memgrad_hf.titans.GatedMemoryBranch`) and
   an instance ``forward`` that returns ``original(x, ...) + sigmoid(W_g x) * W_o NeuralMemory(x)``; ``x`` is the
   layer's input hidden states. ``W_o`` starts at zero: at step 0 the patched model computes what the original does.
   Layers returning a tensor (llama, mistral, qwen2/3 in transformers 5) or a tuple (the sum goes to element 0) work.
3. Memory state. Without a KV cache every forward starts from the learned initial memory (one sequence per call).
   With a transformers ``Cache`` (``past_key_values``) the per-layer :class:`~memgrad_hf.titans.NeuralMemState`
   lives on the cache object: it starts afresh when the cache holds no tokens for the layer (a new sequence) and
   continues otherwise, so feeding a sequence in segments, and cached ``generate()``, equal one uncached forward.
   Beam search (``reorder_cache``) and batch expansion/selection move the memory state with the KV cache; cropping
   a cache (assisted/speculative decoding) raises, since the memory cannot be rolled back.
4. Gradient checkpointing. transformers checkpoints a ``GradientCheckpointingLayer`` inside its class ``forward``;
   the memory branch is checkpointed with the same function (``layer._gradient_checkpointing_func``, so reentrant,
   non-reentrant and offload settings apply) and recomputed in backward like the layer itself.
5. ``model.config.memgrad_titans`` records the :class:`~memgrad_hf.titans.TitansConfig` (saved in ``config.json``);
   the branch parameters are saved by ``save_pretrained`` under ``<layers>.<i>.titans_memory.*``.
   :mod:`memgrad_hf.titans.io` loads them back.

6. Padding. The model's ``attention_mask`` (read by a forward pre-hook on the patched model: 2-D, or the 4-D
   masks ``generate`` builds for a static cache; :mod:`memgrad_hf.patches.titans_masks`) becomes each memory's
   store mask: padded positions never reach the memory (``NeuralMemory(mask=...)``), so left-padded batched
   ``generate()`` works. With padding a multiple of ``chunk_size`` a sequence's outputs equal its unpadded run;
   otherwise its chunk boundaries shift with the padding (the memory is then as valid, just chunked differently).

7. Packed documents. Where transformers itself separates documents packed into one row (``position_ids`` that
   restart, no attention mask, no cache: padding-free training as TRL does it; or a block-diagonal 4-D mask), each
   document's memory starts afresh: the documents are run as a right-padded batch with a store mask and scattered back.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from memgrad_hf.errors import UnsupportedModelError
from memgrad_hf.patches.titans_masks import CACHE_NAMES as _CACHE_NAMES
from memgrad_hf.patches.titans_masks import StoreMask, install_mask_hooks, remove_hooks
from memgrad_hf.patches.unwrap import base_model
from memgrad_hf.titans.branch import GatedMemoryBranch, run_packed_documents
from memgrad_hf.titans.config import TitansConfig
from memgrad_hf.titans.memory import NeuralMemory, NeuralMemState

BRANCH_ATTR = "titans_memory"  # the submodule name on a patched layer (and in state_dict keys)
CONFIG_ATTR = "memgrad_titans"  # model.config attribute holding TitansConfig.to_dict()
_MODEL_ATTR = "_memgrad_titans"
_LAYER_ATTR = "_memgrad_titans_layer"
_CACHE_ATTR = "_memgrad_titans_states"
_MASK_ATTR = "_memgrad_titans_store_mask"  # on the module whose calls the store mask is read from (_mask_reader)
_STATE_NAMES = ("state", "rnn_state")  # a recurrent state a model hands its layers instead of a Cache (xlstm)


@dataclass
class TitansPatch:
    """Bookkeeping stored on a patched model (``model._memgrad_titans``)."""

    config: TitansConfig  # with absolute layer indices
    layers_path: str  # e.g. "model.layers"
    had_config_attr: bool
    previous_config_value: Any
    hook_ids: tuple[int, ...] = ()  # the attention-mask hooks (ids survive deepcopy; handles do not)
    mask_path: str = ""  # the module they are on (see _mask_reader); "": the patched model itself


@dataclass
class _LayerInfo:
    """Bookkeeping stored on a patched layer."""

    index: int  # position in the decoder-layer list (key of the memory state on a cache)
    cache_index: int  # the layer index the KV cache uses for this layer
    had_instance_forward: bool
    previous_forward: Any
    cache_pos: int | None  # its positional index (self excluded), if it can be passed positionally
    store_mask: StoreMask | None = None
    state_pos: int | None = None  # likewise for a recurrent state of the model's own (xlstm's ``state``)


@dataclass
class _CachedState:
    state: NeuralMemState | None
    heads: int


# ------------------------------------------------------------------------------------------ finding the layers


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder-layer list of a transformers model: ``(qualified name, nn.ModuleList)``.

    Looks for an ``nn.ModuleList`` whose elements are transformers ``GradientCheckpointingLayer``s or belong to a
    class named in ``model._no_split_modules``; with several, prefers the one with ``num_hidden_layers`` elements
    outside vision/audio towers.

    Example::

        name, layers = find_decoder_layers(model)   # ("model.layers", ModuleList(...)) for Llama

    Raises:
        UnsupportedModelError: no such list, or several that cannot be told apart.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    no_split = set(getattr(model, "_no_split_modules", None) or [])
    candidates: list[tuple[str, nn.ModuleList]] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0 or f".{BRANCH_ATTR}." in f".{name}.":
            continue
        if all(isinstance(m, GradientCheckpointingLayer) or type(m).__name__ in no_split for m in mod):
            candidates.append((name, mod))
    owner = type(model).__name__
    if not candidates:
        raise UnsupportedModelError(
            f"patch_model(titans=...): found no decoder-layer list in {owner}: Titans injection needs an "
            "nn.ModuleList of decoder layers (transformers GradientCheckpointingLayer subclasses, or classes named in "
            f"{owner}._no_split_modules = {sorted(no_split)})."
        )
    if len(candidates) > 1:
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = getattr(text, "num_hidden_layers", None)
        towers = ("vision", "visual", "audio", "encoder", "image", "speech")
        narrowed = [c for c in candidates if len(c[1]) == n and not any(t in c[0].lower() for t in towers)]
        if len(narrowed) != 1:
            raise UnsupportedModelError(
                f"patch_model(titans=...): {owner} has several decoder-layer lists "
                f"({', '.join(c[0] for c in candidates)}); cannot tell which is the language decoder."
            )
        candidates = narrowed
    return candidates[0]


def _cache_layer_index(layer: nn.Module, default: int) -> int:
    """The first cache layer this decoder layer writes: the smallest ``layer_idx`` of its sub-modules (the attention
    modules, which may be several per decoder layer: longcat_flash's two), else the layer's own, else its position."""
    def idx(m: nn.Module) -> int | None:
        i = getattr(m, "layer_idx", None)
        return i if isinstance(i, int) and not isinstance(i, bool) else None

    inner = [i for m in layer.modules() if m is not layer and (i := idx(m)) is not None]
    own = idx(layer)
    return min(inner) if inner else own if own is not None else default


def _cache_position_arg(forward: Any, names: tuple[str, ...] = _CACHE_NAMES) -> int | None:
    """The positional index of the forward's cache argument (``past_key_values`` & co.; or of ``names``), if any."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for pos, p in enumerate(params):
        if p.name in names:
            return pos if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None
    return None


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "hidden_size", None)
    if not isinstance(size, int):
        raise UnsupportedModelError(
            f"patch_model(titans=...): cannot read the hidden size of {type(model).__name__} (config.hidden_size)."
        )
    return size


# ------------------------------------------------------------------------------------------ memory state on a cache


def _select_batch(state: NeuralMemState, heads: int, batch_index: Tensor) -> NeuralMemState:
    """The state of the sequences ``batch_index`` (states are laid out ``batch x heads`` along dim 0)."""
    ref = state.pending[0]
    idx = batch_index.to(ref.device).long()
    g_idx = (idx[:, None] * heads + torch.arange(heads, device=ref.device)).reshape(-1)
    pick = lambda t: t.index_select(0, g_idx)
    weights = tuple(pick(w) if w.dim() == 3 else w for w in state.weights)
    gamma = pick(state.gamma) if state.gamma.dim() == 2 else state.gamma
    momentum = None if state.momentum is None else tuple(pick(m) if m.dim() >= 1 else m for m in state.momentum)
    pending = tuple(pick(p) for p in state.pending)
    return dataclasses.replace(state, weights=weights, gamma=gamma, momentum=momentum, pending=pending)


def _map_states(cache: Any, fn: Any) -> None:
    for entry in getattr(cache, _CACHE_ATTR, {}).values():
        if entry.state is not None:
            entry.state = fn(entry)


def _cache_reorder_cache(self: Any, beam_idx: Tensor) -> Any:
    _map_states(self, lambda e: _select_batch(e.state, e.heads, beam_idx))
    return type(self).reorder_cache(self, beam_idx)


def _cache_batch_select_indices(self: Any, indices: Tensor) -> Any:
    _map_states(self, lambda e: _select_batch(e.state, e.heads, indices))
    return type(self).batch_select_indices(self, indices)


def _cache_batch_repeat_interleave(self: Any, repeats: int) -> Any:
    def repeat(e: _CachedState) -> NeuralMemState:
        batch = e.state.pending[0].shape[0] // e.heads
        return _select_batch(e.state, e.heads, torch.arange(batch).repeat_interleave(repeats))

    _map_states(self, repeat)
    return type(self).batch_repeat_interleave(self, repeats)


def _cache_crop(self: Any, *args: Any, **kwargs: Any) -> Any:
    tokens = args[0] if args else kwargs.get("tokens_to_remove", kwargs.get("max_length", 0))
    if tokens != 0 and any(e.state is not None and e.state.seq_index > 0 for e in getattr(self, _CACHE_ATTR).values()):
        raise NotImplementedError(
            "crop() on a cache used by Titans memory layers: the memory cannot be rolled back to an earlier token, "
            "so assisted/speculative decoding and other cache rollbacks are not supported with titans=...; "
            "generate without an assistant (greedy, sampling and beam search work)."
        )
    return type(self).crop(self, *args, **kwargs)


def _cache_reset(self: Any, *args: Any, **kwargs: Any) -> Any:
    getattr(self, _CACHE_ATTR).clear()
    return type(self).reset(self, *args, **kwargs)


_CACHE_METHODS = {
    "reorder_cache": _cache_reorder_cache,
    "batch_select_indices": _cache_batch_select_indices,
    "batch_repeat_interleave": _cache_batch_repeat_interleave,
    "crop": _cache_crop,
    "reset": _cache_reset,
}


class _CacheMethod:
    """One of ``_CACHE_METHODS`` installed on a cache instance. It holds the cache weakly: a bound method would make
    the cache refer to itself, and a dropped cache (its K/V tensors with their graph) would wait for Python's cycle
    collector instead of being freed at once. A deep copy of the cache calls it on the copy."""

    def __init__(self, fn: Any, cache: Any) -> None:
        self.fn, self.cache = fn, weakref.ref(cache)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.cache(), *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _CacheMethod:
        cache = self.cache()
        return _CacheMethod(self.fn, memo.get(id(cache), cache))


def _cache_states(cache: Any) -> dict[int, _CachedState]:
    """The memory states kept on ``cache`` (installed on first use, with the batch/beam methods that move them)."""
    states = cache.__dict__.get(_CACHE_ATTR)
    if states is None:
        states = {}
        setattr(cache, _CACHE_ATTR, states)
        for name, fn in _CACHE_METHODS.items():
            if callable(getattr(type(cache), name, None)) and name not in cache.__dict__:
                setattr(cache, name, _CacheMethod(fn, cache))
    return states


def _cache_length(cache: Any, index: int, new_tokens: int) -> int:
    """Tokens the cache held before this forward, read before cache layer ``index`` is written. Where that layer
    counts none (an MLP-only or linear-attention layer of a hybrid model), a later layer's count (not yet written in
    this forward), else an earlier one's less the ``new_tokens`` this forward has written there."""
    layers = getattr(cache, "layers", None)
    n_layers = len(layers) if isinstance(layers, (list, tuple)) else None

    def length(i: int | None = None) -> int | None:
        if i is not None and n_layers is not None and i >= n_layers:
            return None  # not (yet) a layer of this cache: get_seq_length says 0 (minimax keeps its own state)
        try:
            return int(cache.get_seq_length() if i is None else cache.get_seq_length(i))
        except (ValueError, IndexError, TypeError):  # e.g. a DummyLayer: tracks no length
            return None

    if (n := length(index)) is not None:
        return n
    if n_layers is not None:
        for j in [*range(index + 1, n_layers), *range(min(index, n_layers) - 1, -1, -1)]:
            if (n := length(j)) is not None:
                return n if j > index else n - new_tokens
    if (n := length()) is not None:
        return n
    raise UnsupportedModelError(
        f"Titans memory: this model's {type(cache).__name__} holds no attention layer, so it does not count tokens "
        "and the memory state cannot follow it. Run the model uncached: model(..., use_cache=False), "
        "generate(..., use_cache=False) (training uses no cache)."
    )


# ------------------------------------------------------------------------------------------ the patched forward


def _checkpointing(layer: nn.Module) -> bool:
    """Whether transformers checkpoints this layer's forward in this call (then it also drops the KV cache): as
    ``GradientCheckpointingLayer`` decides, so not under ``no_grad`` (``generate`` from a model in train mode)."""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training and torch.is_grad_enabled()


class _PatchedForward:
    """A patched layer's ``forward``: a callable object, not a bound function, so that a pickled model
    (``torch.save(model)``, multiprocessing) loads with its memory branch running (a bound method is pickled by its
    name, which the layer's class does not have). A deep copy calls the copied layer."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _patched_layer_forward(self.layer, *args, **kwargs)


def _patched_layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The decoder layer's forward plus its memory branch: ``layer(x) + branch(x)``, the memory state carried in the
    KV cache when there is one (generation), else started afresh (training; packed documents each from a fresh
    memory)."""
    info: _LayerInfo = getattr(self, _LAYER_ATTR)
    x = _layer_input(self, args, kwargs)
    checkpointing = _checkpointing(self)
    cache = _layer_cache(self, info, args, kwargs, checkpointing)
    entry, state = (None, None) if cache is None else _cached_memory_state(self, info, cache, x)
    if info.previous_forward is not None:
        out = info.previous_forward(*args, **kwargs)
    else:
        out = type(self).forward(self, *args, **kwargs)
    branch = getattr(self, BRANCH_ATTR)
    original = branch._modules.get("original_module")  # PEFT's modules_to_save wrapper: the memory has a trained copy
    if original is not None and not getattr(original, "_inert_checked", False):
        original._inert_checked = True  # (its frozen original runs under disable_adapter() by design: no warning)
    mask = _layer_mask(info, x)
    starts = None if info.store_mask is None or cache is not None else info.store_mask.starts
    if starts is not None and starts.shape[1] == x.shape[1]:  # packed documents: each from a fresh memory
        run = lambda h: run_packed_documents(branch, h, starts.expand(h.shape[0], -1), mask)
    else:
        run = lambda h: branch(h, None, mask)[0]
    if checkpointing and cache is None and callable(getattr(self, "_gradient_checkpointing_func", None)):
        delta = self._gradient_checkpointing_func(run, x)
        new_state = None
    elif cache is None:
        delta, new_state = run(x), None
    else:
        delta, new_state = branch(x, state, mask)
    if entry is not None:
        entry.state = new_state
    return _add_to_output(out, delta, x, type(self).__name__)


def _layer_input(layer: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """The layer call's hidden states, ``(batch, tokens, hidden_size)``, or a refusal naming what the model passes."""
    x = args[0] if args else kwargs.get("hidden_states")
    name = type(layer).__name__
    if not isinstance(x, Tensor):
        raise UnsupportedModelError(
            f"Titans memory on {name}: the layer was not called with hidden states as its first argument."
        )
    dim = _memory_of(layer).dim
    if x.dim() != 3 or x.shape[-1] != dim:
        raise UnsupportedModelError(
            f"Titans memory on {name}: its hidden states have shape {tuple(x.shape)}, but the memory takes "
            f"(batch, tokens, hidden_size={dim}). Models that carry several residual streams through their layers "
            "(hyper-connections, AltUp) or a width other than hidden_size are not supported."
        )
    return x


def _layer_cache(layer: nn.Module, info: _LayerInfo, args: tuple, kwargs: dict, checkpointing: bool) -> Any:
    """The transformers Cache the layer call carries (None: the memory starts afresh); a model's own recurrent
    state, which the memory cannot follow, is refused."""
    name = type(layer).__name__
    cache = next((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), None)
    if cache is None and info.cache_pos is not None and len(args) > info.cache_pos:
        cache = args[info.cache_pos]
    if checkpointing and not getattr(layer, "_can_checkpoint_with_cache", False):
        cache = None  # transformers drops the KV cache of a checkpointed layer too: the memory starts afresh
    elif cache is None and kwargs.get("use_cache"):
        raise UnsupportedModelError(
            f"Titans memory on {name}: called with use_cache=True but no transformers Cache reached the layer (the "
            "model keeps a state of its own), so the memory state cannot follow it. Run the model uncached: "
            "model(..., use_cache=False), generate(..., use_cache=False) (training uses no cache)."
        )
    own = next((kwargs[n] for n in _STATE_NAMES if kwargs.get(n) is not None), None)
    if own is None and info.state_pos is not None and len(args) > info.state_pos:
        own = args[info.state_pos]
    if own is not None:
        raise UnsupportedModelError(
            f"Titans memory on {name}: the layer was handed a recurrent state of the model's own "
            f"({type(own).__name__}: a cached call, or a long sequence the model splits into chunks), which the "
            "memory state cannot follow. Run the model uncached, on whole sequences: model(..., use_cache=False), "
            "generate(..., use_cache=False) (training uses neither)."
        )
    if cache is not None and not callable(getattr(cache, "get_seq_length", None)):
        raise UnsupportedModelError(
            f"Titans memory on {name}: past_key_values is a {type(cache).__name__}; a transformers Cache "
            "(e.g. DynamicCache) is needed to carry the memory state."
        )
    return cache


def _cached_memory_state(layer: nn.Module, info: _LayerInfo, cache: Any, x: Tensor,
                         ) -> tuple[_CachedState, NeuralMemState | None]:
    """``(the cache's entry for this layer, the memory state to continue from)``: the state must have seen exactly
    the tokens the cache holds (read before the layer writes its keys/values); the entry gets the new state."""
    name = type(layer).__name__
    past = _cache_length(cache, info.cache_index, x.shape[1])
    states = _cache_states(cache)
    entry = states.get(info.index)
    state = None
    if past > 0:
        if entry is None or entry.state is None:
            raise ValueError(
                f"Titans memory on layer {info.index}: the cache already holds {past} tokens but no memory state "
                "for this layer (it was filled by the model without Titans, or under gradient checkpointing). "
                "Start from an empty cache."
            )
        seen = entry.state.seq_index
        if seen > past and seen % past == 0:  # the same multiple at every call: streams, not an edit
            raise UnsupportedModelError(
                f"Titans memory on layer {info.index} ({name}): the layer saw {seen} positions for the {past} "
                f"tokens its cache holds, {seen // past} per token (several streams through one layer, as in "
                "ProphetNet's n-gram decoder), so the memory state cannot follow the cache. Run the model "
                "uncached: model(..., use_cache=False), generate(..., use_cache=False) (training uses no cache)."
            )
        if seen != past:
            raise ValueError(
                f"Titans memory on layer {info.index}: the cache holds {past} tokens but the memory has seen "
                f"{seen}; the cache was changed outside the model (cropped or edited)."
            )
        state = entry.state
    entry = states[info.index] = _CachedState(None, _branch_heads(layer))
    return entry, state


def _add_to_output(out: Any, delta: Tensor, x: Tensor, name: str) -> Any:
    """The layer's output with ``delta`` added to its hidden states (a tensor, or the first of a tuple/list)."""
    hidden = out if isinstance(out, Tensor) else out[0] if isinstance(out, (tuple, list)) else None
    if not isinstance(hidden, Tensor) or hidden.shape != x.shape:
        raise UnsupportedModelError(
            f"Titans memory on {name}: the layer must return its output hidden states (a tensor of the input's shape, "
            f"or a tuple starting with one); it returned {type(out).__name__}."
        )
    hidden = hidden + delta.to(hidden.dtype)
    if isinstance(out, Tensor):
        return hidden
    return [hidden, *out[1:]] if isinstance(out, list) else (hidden, *out[1:])


def _layer_mask(info: _LayerInfo, x: Tensor) -> Tensor | None:
    """The store mask of this layer call's tokens: the last ``T`` columns of the model's 2-D attention mask."""
    mask = None if info.store_mask is None else info.store_mask.mask
    if mask is None or mask.shape[0] != x.shape[0] or mask.shape[1] < x.shape[1]:
        return None
    return mask[:, mask.shape[1] - x.shape[1]:]


def _store_mask_of(module: nn.Module) -> StoreMask:
    return module.__dict__[_MASK_ATTR]


def _mask_reader(model: nn.Module, layers_path: str) -> str:
    """Path of the module whose calls say which tokens are padding or start a packed document: the one holding the
    decoder-layer list (``model.model``), when its forward takes an ``attention_mask``, so that a call to the backbone
    alone (a value or reward head, an embedding extractor) keeps padding out of the memory too; else the patched
    model itself ("")."""
    owner = layers_path.rpartition(".")[0]
    try:
        takes_mask = "attention_mask" in inspect.signature(model.get_submodule(owner).forward).parameters
    except (TypeError, ValueError):
        takes_mask = False
    return owner if takes_mask else ""


def _memory_of(layer: nn.Module) -> NeuralMemory:
    # modules(), not .memory: the branch may sit in a PEFT ModulesToSaveWrapper (all copies have the same shape)
    return next(m for m in getattr(layer, BRANCH_ATTR).modules() if isinstance(m, NeuralMemory))


def _branch_heads(layer: nn.Module) -> int:
    return _memory_of(layer).heads


# ------------------------------------------------------------------------------------------ public entry points


def _as_config(titans: Any) -> TitansConfig:
    if isinstance(titans, TitansConfig):
        return titans
    if isinstance(titans, dict):
        return TitansConfig(**titans)
    raise ValueError(
        f"titans=...: expected a memgrad_hf.titans.TitansConfig (or its dict); got {type(titans).__name__}."
    )


def _layer_index(i: Any) -> int:
    """``i`` as a Python int: numpy and 0-d tensor integers are accepted (``np.arange``), bools and floats are not."""
    if isinstance(i, bool) or getattr(i, "dtype", None) == torch.bool:
        raise ValueError(f"TitansConfig.layers: {i!r} is not an integer layer index.")
    try:
        return operator.index(i)
    except TypeError:
        raise ValueError(f"TitansConfig.layers: {i!r} is not an integer layer index.") from None


def _resolve_layers(indices: Any, n: int) -> list[int]:
    if isinstance(indices, int) or getattr(indices, "ndim", None) == 0:
        indices = [indices]
    indices = list(indices)  # (not `if not indices`: a tensor's truth is its value, tensor([0]) is falsy)
    if not indices:
        raise ValueError("TitansConfig.layers is empty; name at least one decoder layer (e.g. layers=[-1]).")
    out = []
    for i in map(_layer_index, indices):
        if not -n <= i < n:
            raise ValueError(f"TitansConfig.layers: index {i} is out of range for a model with {n} decoder layers.")
        j = i % n
        if j in out:
            raise ValueError(f"TitansConfig.layers: layer {j} is named twice ({list(indices)}).")
        out.append(j)
    return sorted(out)


def is_titans_patched(model: nn.Module) -> bool:
    """Whether :func:`inject_titans` (``patch_model(model, titans=...)``) has added memory to ``model``."""
    return isinstance(getattr(model, _MODEL_ATTR, None), TitansPatch)


def titans_branches(model: nn.Module) -> dict[int, nn.Module]:
    """The memory branches of a patched model, by decoder-layer index.

    Example::

        for i, branch in titans_branches(model).items():
            branch.memory.grad_impl = "autograd"     # e.g. switch to the torch.func reference
        sync_titans_config(model)                    # so that a save records it
    """
    patch = getattr(model, _MODEL_ATTR, None)
    if not isinstance(patch, TitansPatch):
        return {}
    layers = model.get_submodule(patch.layers_path)
    return {i: getattr(layers[i], BRANCH_ATTR) for i in patch.config.layers}


def live_memories(module: nn.Module) -> list[NeuralMemory]:
    """The :class:`NeuralMemory` modules in ``module`` that run, leaving out the frozen originals PEFT keeps beside
    its trainable copies (``modules_to_save=["titans_memory"]``: ``...titans_memory.original_module``), which only
    run under ``disable_adapter()`` and must keep computing what the base model computed."""
    return [m for name, m in module.named_modules()
            if isinstance(m, NeuralMemory) and "original_module" not in name.split(".")]


def sync_titans_config(model: nn.Module) -> None:
    """Record the memories' current ``grad_impl``, and whether their FANs are frozen, in the model's
    :class:`TitansConfig` (``model.config.memgrad_titans``, which ``save_pretrained`` writes, and the patch's own copy),
    so that a saved model reloads the gradient that ran and trains what trained. ``FANDistillationCallback`` calls it
    when it switches the memories to ``"fan"``; call it after switching by hand. Memories left on different gradients
    are recorded as they were patched.

    Example::

        titans_branches(model)[3].memory.grad_impl = "fan"; sync_titans_config(model); model.save_pretrained("out")
    """
    base = base_model(model)
    patch = getattr(base, _MODEL_ATTR, None)
    if not isinstance(patch, TitansPatch):
        return
    memories = [m for b in titans_branches(base).values() for m in live_memories(b)]
    impls = {m.grad_impl for m in memories}
    changes: dict[str, Any] = {}
    if len(impls) == 1 and patch.config.grad_impl not in impls:
        changes["grad_impl"] = impls.pop()
    fans = [m.fan for m in memories if m.fan is not None]
    frozen = bool(fans) and all(f.frozen or not any(p.requires_grad for p in f.parameters()) for f in fans)
    if frozen != patch.config.fan_frozen:
        changes["fan_frozen"] = frozen
    if not changes:
        return
    patch.config = dataclasses.replace(patch.config, **changes)
    if getattr(base, "config", None) is not None:
        setattr(base.config, CONFIG_ATTR, patch.config.to_dict())


def inject_titans(model: nn.Module, titans: TitansConfig | dict[str, Any]) -> nn.Module:
    """Add a gated Titans memory branch to the decoder layers ``titans.layers`` of ``model`` (in place).

    Usually called through ``memgrad_hf.patch_model(model, titans=TitansConfig(...))``. At step 0 the patched model's
    outputs equal the original's (the branch's output projection is zero); the branch parameters train with the rest
    of the model, are saved by ``save_pretrained`` and load with :func:`memgrad_hf.titans.from_pretrained`.

    Example::

        from memgrad_hf.titans import TitansConfig
        memgrad_hf.patch_model(model, titans=TitansConfig(layers=[2, 4, -1], heads=4, chunk_size=64))

    Raises:
        UnsupportedModelError: no decoder-layer list found (the message names the class).
        ValueError: bad layer indices or memory settings, or the model already has Titans memory.
    """
    config = _as_config(titans)
    if is_titans_patched(model):
        raise ValueError(
            f"{type(model).__name__} already has Titans memory layers; call memgrad_hf.unpatch_model(model) first."
        )
    path, layers = find_decoder_layers(model)
    indices = _resolve_layers(config.layers, len(layers))
    config = dataclasses.replace(config, layers=indices)
    dim = _hidden_size(model)
    branches: dict[int, GatedMemoryBranch] = {}
    for i in indices:  # build everything first: a bad setting leaves the model untouched
        layer = layers[i]
        if hasattr(layer, BRANCH_ATTR) or _LAYER_ATTR in layer.__dict__:
            raise ValueError(f"decoder layer {i} of {type(model).__name__} already has a '{BRANCH_ATTR}' attribute.")
        ref = next((p for p in layer.parameters() if p.is_floating_point()), None)
        branch = GatedMemoryBranch(dim, **config.memory_kwargs())
        if ref is not None:
            branch.to(device=ref.device, dtype=ref.dtype)
        if config.fan_frozen:  # (saved after FANDistillationCallback froze them)
            for m in branch.modules():
                if isinstance(m, NeuralMemory) and m.fan is not None:
                    m.fan.requires_grad_(False)
        branches[i] = branch
    holder = StoreMask()
    inert_warned = [False]  # (one "inert branch" warning per model, not per memory layer)
    for i, branch in branches.items():
        branch._inert_warned = inert_warned
        layer = layers[i]
        had = "forward" in layer.__dict__
        previous = layer.__dict__.get("forward")
        forward = previous if had else type(layer).forward
        cache_pos, state_pos = (_cache_position_arg(forward, names) for names in (_CACHE_NAMES, _STATE_NAMES))
        if not had:  # the class forward's signature includes self
            cache_pos, state_pos = (None if p is None else p - 1 for p in (cache_pos, state_pos))
        layer.add_module(BRANCH_ATTR, branch)
        setattr(layer, _LAYER_ATTR, _LayerInfo(i, _cache_layer_index(layer, i), had, previous, cache_pos, holder,
                                               state_pos))
        layer.forward = _PatchedForward(layer)
    model_config = getattr(model, "config", None)
    had_attr = model_config is not None and CONFIG_ATTR in getattr(model_config, "__dict__", {})
    previous_value = getattr(model_config, CONFIG_ATTR, None) if had_attr else None
    if model_config is not None:
        setattr(model_config, CONFIG_ATTR, config.to_dict())
    reader_path = _mask_reader(model, path)
    reader = model.get_submodule(reader_path)
    reader.__dict__[_MASK_ATTR] = holder  # (in __dict__: a deep copy of the model gets its own, as its layers do)
    setattr(model, _MODEL_ATTR, TitansPatch(config, path, had_attr, previous_value,
                                            install_mask_hooks(reader, _store_mask_of), reader_path))
    return model


def remove_titans(model: nn.Module) -> nn.Module:
    """Undo :func:`inject_titans` exactly: branches removed, original layer forwards and config restored.

    A model without Titans memory is returned unchanged. ``memgrad_hf.unpatch_model(model)`` calls this.

    Example::

        memgrad_hf.unpatch_model(model)   # removes the chunked head too; remove_titans(model) only the memory
    """
    patch = getattr(model, _MODEL_ATTR, None)
    if not isinstance(patch, TitansPatch):
        return model
    layers = model.get_submodule(patch.layers_path)
    for i in patch.config.layers:
        layer = layers[i]
        info: _LayerInfo = layer.__dict__.pop(_LAYER_ATTR)
        layer.__dict__.pop("forward", None)
        if info.had_instance_forward:
            layer.forward = info.previous_forward
        del layer._modules[BRANCH_ATTR]
    model_config = getattr(model, "config", None)
    if model_config is not None:
        if patch.had_config_attr:
            setattr(model_config, CONFIG_ATTR, patch.previous_config_value)
        elif CONFIG_ATTR in getattr(model_config, "__dict__", {}):
            delattr(model_config, CONFIG_ATTR)
    reader = model.get_submodule(patch.mask_path)
    remove_hooks(reader, patch.hook_ids)
    reader.__dict__.pop(_MASK_ATTR, None)
    delattr(model, _MODEL_ATTR)
    return model


__all__ = [
    "BRANCH_ATTR",
    "CONFIG_ATTR",
    "TitansPatch",
    "find_decoder_layers",
    "inject_titans",
    "is_titans_patched",
    "remove_titans",
    "sync_titans_config",
    "titans_branches",
]
