"""Saving and loading Titans memory layers.

A model patched with ``patch_model(model, titans=cfg)`` saves with plain ``model.save_pretrained(path)``:

- the memory parameters are ordinary parameters of the decoder layers (``model.layers.<i>.titans_memory.*``), so
  they go into ``model.safetensors`` with the original weights (whose keys do not change);
- ``config.json`` gets ``"memgrad_titans": cfg.to_dict()``.

Plain transformers still loads such a checkpoint (it reports the ``titans_memory`` keys as unexpected and builds the
original model). :func:`from_pretrained` loads it with the memory: plain ``from_pretrained``, re-injection from the
saved config, then the memory weights from the checkpoint's safetensors files. For a model whose own
``save_pretrained`` does not write the base weights (PEFT adapters), :func:`save_titans` / :func:`load_titans` keep the
memory in a separate ``memgrad_titans.safetensors`` (config in its metadata).
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from memgrad_hf.patches.unwrap import base_model
from memgrad_hf.titans.config import TitansConfig

logger = logging.getLogger(__name__)

TITANS_WEIGHTS_NAME = "memgrad_titans.safetensors"
_KEY = re.compile(r"(?:^|\.)(\d+)\.titans_memory\.(.+)$")
_META_KEY = "memgrad_titans"
_EXPECTED_PATTERN = r"\.titans_memory\."


def _canonical(key: str) -> tuple[int, str] | None:
    """``(layer index, parameter path inside the branch)`` of a memory key, whatever prefix the checkpoint uses."""
    m = _KEY.search(key)
    return (int(m.group(1)), m.group(2)) if m else None


def titans_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The Titans memory tensors of a patched model, keyed as in ``model.state_dict()``.

    Example::

        sd = titans_state_dict(model)   # {"model.layers.3.titans_memory.out.weight": ..., ...}
    """
    return {k: v for k, v in base_model(model).state_dict().items() if _canonical(k) is not None}


def save_titans(model: nn.Module, save_directory: str | os.PathLike) -> str:
    """Write only the memory (tensors + config) to ``save_directory/memgrad_titans.safetensors``; return the path.

    Useful when ``save_pretrained`` does not write the base weights (e.g. a PEFT model saves adapters only).

    Example::

        save_titans(model, "out")      # later: load_titans(model, "out")
    """
    from safetensors.torch import save_file

    from memgrad_hf.patches.titans import is_titans_patched, sync_titans_config

    base = base_model(model)
    if not is_titans_patched(base):
        raise ValueError(f"save_titans: {type(base).__name__} has no Titans memory (patch_model(model, titans=...)).")
    sync_titans_config(base)
    os.makedirs(save_directory, exist_ok=True)
    path = os.path.join(os.fspath(save_directory), TITANS_WEIGHTS_NAME)
    tensors = {k: v.detach().contiguous().cpu() for k, v in titans_state_dict(base).items()}
    save_file(tensors, path, metadata={"format": "pt", _META_KEY: json.dumps(base._memgrad_titans.config.to_dict())})
    return path


def _checkpoint_files(path: str, hub_kwargs: dict[str, Any]) -> list[str]:
    """The safetensors files that may hold memory tensors: ``memgrad_titans.safetensors``, else the model's."""
    if os.path.isfile(path):
        return [path]
    names = [TITANS_WEIGHTS_NAME, "model.safetensors", "model.safetensors.index.json"]
    found: dict[str, str] = {}
    for name in names:
        local = os.path.join(path, name)
        if os.path.isdir(path):
            if os.path.isfile(local):
                found[name] = local
            continue
        from transformers.utils import cached_file

        resolved = cached_file(path, name, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        if resolved:
            found[name] = resolved
    if TITANS_WEIGHTS_NAME in found:
        return [found[TITANS_WEIGHTS_NAME]]
    if "model.safetensors" in found:
        return [found["model.safetensors"]]
    if "model.safetensors.index.json" in found:
        index = found["model.safetensors.index.json"]
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        shards = sorted({v for k, v in weight_map.items() if _canonical(k) is not None})
        if os.path.isdir(path):
            return [os.path.join(path, s) for s in shards]
        from transformers.utils import cached_file

        return [cached_file(path, s, **hub_kwargs) for s in shards]
    raise FileNotFoundError(f"load_titans: no safetensors checkpoint at {path!r} (looked for {', '.join(names)}).")


def _read_titans(files: list[str]) -> tuple[dict[tuple[int, str], Tensor], dict[str, Any] | None]:
    from safetensors import safe_open

    tensors: dict[tuple[int, str], Tensor] = {}
    config = None
    for file in files:
        with safe_open(file, framework="pt") as f:
            meta = f.metadata() or {}
            if _META_KEY in meta:
                config = json.loads(meta[_META_KEY])
            for key in f.keys():
                canon = _canonical(key)
                if canon is not None:
                    tensors[canon] = f.get_tensor(key)
    return tensors, config


def load_titans(model: nn.Module, path: str | os.PathLike, **hub_kwargs: Any) -> nn.Module:
    """Load Titans memory weights from a checkpoint into ``model``, injecting the memory first if needed.

    ``path``: a directory written by ``save_pretrained`` (memory inside ``model.safetensors``, sharded or not) or by
    :func:`save_titans`, a ``.safetensors`` file, or a hub repository id (``hub_kwargs`` go to the download). The
    :class:`TitansConfig` comes from the model (if already patched), ``model.config.memgrad_titans``, or the
    ``memgrad_titans.safetensors`` metadata. Every memory tensor must be present in the checkpoint.

    Example::

        model = AutoModelForCausalLM.from_pretrained("out")   # plain load: memory keys ignored
        load_titans(model, "out")                             # memory back, outputs as saved

    Raises:
        ValueError: no Titans config found, or the checkpoint's memory tensors do not match the model's.
    """
    from memgrad_hf.patches.titans import BRANCH_ATTR, CONFIG_ATTR, inject_titans, is_titans_patched

    base = base_model(model)
    tensors, meta_config = _read_titans(_checkpoint_files(os.fspath(path), hub_kwargs))
    patched_before = is_titans_patched(base)
    if not patched_before:
        saved = getattr(getattr(base, "config", None), CONFIG_ATTR, None) or meta_config
        if saved is None:
            raise ValueError(
                f"load_titans: no Titans config for {type(base).__name__}: neither model.config.{CONFIG_ATTR} nor "
                f"{TITANS_WEIGHTS_NAME} metadata at {os.fspath(path)!r}."
            )
        inject_titans(base, TitansConfig(**saved))
    own = {}
    for key, param in base.state_dict(keep_vars=True).items():
        canon = _canonical(key)
        if canon is not None:
            own[canon] = (key, param)
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if unexpected and not missing and all(".fan." in f".{n}" for _, n in unexpected):
        raise ValueError(f"load_titans: the checkpoint at {os.fspath(path)!r} holds FANs that the model's memories do "
                         "not have; patch with TitansConfig(..., fan=True), or call load_titans on a model not yet "
                         "patched to take the saved configuration.")
    if missing and unexpected and all("modules_to_save." in n or "original_module." in n for _, n in unexpected):
        raise ValueError(f"load_titans: the checkpoint at {os.fspath(path)!r} was saved from a PEFT model with "
                         "modules_to_save=['titans_memory'] (its keys are PEFT's copies): load it into that PEFT model "
                         "(PeftModel.from_pretrained, then load_titans), or merge before saving "
                         "(peft_model.merge_and_unload(), then save_pretrained / save_titans).")
    if missing or unexpected:
        fmt = lambda ks: ", ".join(f"layers.{i}.{BRANCH_ATTR}.{n}" for i, n in ks[:6]) + (" ..." if len(ks) > 6 else "")
        raise ValueError(
            f"load_titans: the checkpoint at {os.fspath(path)!r} does not match the model's memory layers"
            + (f"; missing: {fmt(missing)}" if missing else "")
            + (f"; unexpected: {fmt(unexpected)}" if unexpected else "")
            + ". Patch the model with the checkpoint's TitansConfig (its config.json's memgrad_titans), or call "
            "load_titans on a model not yet patched to take the saved one."
        )
    with torch.no_grad():
        for canon, (key, param) in own.items():
            value = tensors[canon]
            if value.shape != param.shape:
                raise ValueError(f"load_titans: {key} has shape {tuple(value.shape)} in the checkpoint, "
                                 f"{tuple(param.shape)} in the model.")
            param.copy_(value)
    if patched_before:
        _take_saved_mode(base, meta_config or _config_json_titans(os.fspath(path), hub_kwargs), os.fspath(path))
    return model


def _config_json_titans(path: str, hub_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``memgrad_titans`` of the ``config.json`` beside a ``save_pretrained`` checkpoint, if any."""
    if os.path.isfile(path):
        path = os.path.dirname(path) or "."
    local = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        from transformers.utils import cached_file

        local = cached_file(path, "config.json", _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    if not local or not os.path.isfile(local):
        return None
    with open(local) as f:
        return json.load(f).get(_META_KEY)


def _take_saved_mode(base: nn.Module, saved: dict[str, Any] | None, path: str) -> None:
    """Weights loaded into a model that was already patched: give its memories the gradient they ran with when saved
    (``grad_impl="fan"`` after a FAN switch) and their FANs' frozen state, as :func:`from_pretrained` does; the
    model's own settings would compute something else with the saved weights. Other settings that differ are
    warned about (they are the model's to choose, e.g. a longer ``chunk_size`` for inference)."""
    from memgrad_hf.patches.titans import _MODEL_ATTR, live_memories, sync_titans_config, titans_branches

    if not saved:
        return
    memories = [m for b in titans_branches(base).values() for m in live_memories(b)]
    impl, frozen = saved.get("grad_impl"), bool(saved.get("fan_frozen", False))
    if impl == "fan" and any(m.fan is None for m in memories):
        raise ValueError(f"load_titans: the checkpoint at {path!r} runs its memories on their FANs (grad_impl='fan'), "
                         "but the model's memories have none; patch with TitansConfig(..., fan=True).")
    for m in memories:
        if impl is not None:
            m.grad_impl = impl
        if m.fan is not None:
            m.fan.requires_grad_(not frozen)
    sync_titans_config(base)
    own = getattr(base, _MODEL_ATTR).config.to_dict()
    differ = sorted(k for k, v in saved.items() if k in own and own[k] != v)
    if differ:
        logger.warning("load_titans: the checkpoint at %r was saved with other Titans settings than the model's (%s); "
                       "the model keeps its own.", path,
                       ", ".join(f"{k}: saved {saved[k]!r}, model {own[k]!r}" for k in differ))


@contextmanager
def _titans_keys_expected(model_class: Any, path: str, kwargs: dict[str, Any]):
    """While loading, have transformers not report the memory keys as unexpected (they are loaded right after)."""
    cls = model_class
    try:
        if hasattr(model_class, "_model_mapping"):  # an Auto class: find the concrete class
            from transformers import AutoConfig

            config = kwargs.get("config")
            if config is None or isinstance(config, str):
                config = AutoConfig.from_pretrained(config or path, **{
                    k: kwargs[k] for k in ("revision", "token", "cache_dir", "trust_remote_code") if k in kwargs})
            cls = model_class._model_mapping[type(config)]
    except Exception:  # cannot tell the class: the load report just lists the memory keys
        cls = None
    if cls is None or not isinstance(cls, type):
        yield
        return
    had = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
    before = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
    cls._keys_to_ignore_on_load_unexpected = set(before or getattr(cls, "_keys_to_ignore_on_load_unexpected", None)
                                                 or []) | {_EXPECTED_PATTERN}
    try:
        yield
    finally:
        if had:
            cls._keys_to_ignore_on_load_unexpected = before
        else:
            del cls._keys_to_ignore_on_load_unexpected


def _saved_model_class(path: str, hub_kwargs: dict[str, Any]) -> Any:
    """The class ``save_pretrained`` recorded in the config (a seq2seq model is no ``AutoModelForCausalLM``), else
    ``AutoModelForCausalLM``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, **hub_kwargs)
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def from_pretrained(path: str | os.PathLike, *, model_class: Any = None, **kwargs: Any) -> nn.Module:
    """Load a checkpoint saved from a Titans-patched model, memory included.

    Loads with ``model_class.from_pretrained(path, **kwargs)`` (default: the class named in the saved config's
    ``architectures``, else ``AutoModelForCausalLM``; ``dtype``, ``device_map`` etc. pass through), re-injects
    the memory from ``config.memgrad_titans`` and loads its weights. The result is a patched model
    (``patch_model(model)`` can add the chunked head; ``unpatch_model`` removes both).

    Example::

        model = memgrad_hf.patch_model(model, titans=TitansConfig(layers=[-1]))
        ...train...
        model.save_pretrained("out")
        model = memgrad_hf.titans.from_pretrained("out")   # same outputs as the model that was saved
    """
    path = os.fspath(path)
    hub_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
    if model_class is None:
        remote = {k: kwargs[k] for k in ("trust_remote_code",) if k in kwargs}
        model_class = _saved_model_class(path, {**hub_kwargs, **remote})
    with _titans_keys_expected(model_class, path, kwargs):
        model = model_class.from_pretrained(path, **kwargs)
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    if isinstance(ignored, set):  # the instance copied the temporary pattern; the memory is loaded below
        ignored.discard(_EXPECTED_PATTERN)
    return load_titans(model, path, **hub_kwargs)


__all__ = ["TITANS_WEIGHTS_NAME", "from_pretrained", "load_titans", "save_titans", "titans_state_dict"]
