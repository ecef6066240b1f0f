"""What FORGE optimizers refuse or warn about at construction: options, dtypes, distributed and PEFT setups."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from memgrad_hf.kernels import forge as K

log = logging.getLogger("memgrad_hf.forge")

OPTION_CHOICES = {"clip": ("exact", "previous"), "clip_pass": ("auto", "replay", "backward"),
                  "head_grad": ("auto", "recompute", "hold"), "kernel": ("auto", "fused", "split")}


def check_options(*, tile_bytes: int | None, max_grad_norm: float | None, **choices: str) -> None:
    """Refuse a FORGE constructor option outside its choices (``clip``, ``clip_pass``, ``head_grad``, ``kernel``), a
    non-positive ``tile_bytes`` or a negative or non-finite ``max_grad_norm``."""
    for name, value in choices.items():
        if value not in OPTION_CHOICES[name]:
            raise ValueError(f"{name} must be one of {OPTION_CHOICES[name]}; got {value!r}.")
    if tile_bytes is not None and int(tile_bytes) < 1:
        raise ValueError(f"tile_bytes must be a positive number of bytes (or None: automatic); got {tile_bytes}.")
    if max_grad_norm is None or max_grad_norm < 0 or not math.isfinite(max_grad_norm):
        raise ValueError(f"max_grad_norm must be a finite number >= 0 (0 disables clipping); got {max_grad_norm}.")


def parse_state_dtype(d: torch.dtype | str | None) -> torch.dtype | None:
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "8bit": K.Q_DTYPE}
    if d is None or (isinstance(d, str) and d.lower() == "auto"):
        return None
    if isinstance(d, str):
        if d.lower() not in table:
            raise ValueError(f"state_dtype must be one of {sorted(table) + ['auto']}; got {d!r}.")
        return table[d.lower()]
    if d not in (torch.float32, torch.bfloat16, K.Q_DTYPE):
        raise ValueError(f"state_dtype must be torch.float32, torch.bfloat16 or '8bit'; got {d}.")
    return d


def check_flag(owner: str, name: str, value: Any) -> bool:
    """``value`` as a bool, refusing what is not one: ``bool("false")`` is True, so a flag read from a config file
    as a string would silently turn on."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{owner}: {name} must be True or False; got {value!r} ({type(value).__name__}).")


def note_low_precision_weights(groups: list[dict[str, Any]], state_dtype: torch.dtype | None) -> None:
    """bf16/fp16 weights with (explicitly asked for) fp32 state hold twice the state ``adamw_torch`` holds for them
    (torch keeps state in the weights' dtype, as FORGE's default does): say so once, since users pick FORGE to save
    memory. Logged at INFO: the choice was explicit."""
    params = [p for g in groups for p in g["params"]]
    low = sum(p.numel() for p in params if p.dtype in (torch.bfloat16, torch.float16))
    if state_dtype == torch.float32 and low * 2 > sum(p.numel() for p in params):
        log.info(
            "forge: the model's weights are bf16/fp16 and the optimizer state fp32 (more accurate, but twice the state "
            "torch.optim keeps for such weights); the default (state_dtype=auto) keeps bf16 state for them, as torch "
            "does, and optim_args='state_dtype=8bit' a quarter of it."
        )


def note_gradient_readers(model: nn.Module) -> None:
    """PEFT methods whose training reads ``.grad`` after backward, which FORGE never leaves (see the warning)."""
    configs = getattr(model, "peft_config", None)
    for name, cfg in (configs.items() if isinstance(configs, dict) else ()):
        kind = str(getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", "")))
        what = {"ADALORA": "AdaLoRA's rank allocation (model.update_and_allocate)",
                "ADAMSS": "ADAMSS's adaptive subspace allocation (AdamssAsaCallback)"}.get(kind.upper())
        if what and (kind.upper() != "ADAMSS" or getattr(cfg, "use_asa", False)):
            log.warning(
                "forge: adapter %r: %s scores parameters by their .grad after backward, and FORGE applies each update "
                "inside backward and leaves no .grad: update_and_allocate raises a TypeError, a callback that skips "
                "missing gradients silently allocates nothing. The adapter still trains, without reallocation; for "
                "that, train it with torch.optim (e.g. optim='adamw_torch').", name, what)


def refuse_sparse_gradients(owner: str, model: nn.Module, params: set[nn.Parameter]) -> None:
    """An ``nn.Embedding(sparse=True)`` whose weight trains: its sparse gradient has no FORGE update. Refused at
    construction (in backward it would fail after the other layers had stepped)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and m.sparse and m.weight in params and m.weight.requires_grad:
            raise ValueError(
                f"{owner}: {name or 'the model'} is nn.Embedding(sparse=True), whose sparse gradient FORGE cannot "
                "apply. Use sparse=False, or leave that embedding out of this optimizer (e.g. torch.optim.SparseAdam "
                "for it).")


def refuse_offloaded(owner: str, params: list[nn.Parameter]) -> None:
    """Parameters on the meta device: offloaded by accelerate (``device_map`` with CPU/disk offload, ``cpu_offload``,
    ``disk_offload``), whose hook loads each one into a temporary tensor for every forward. Their gradient and update
    would go to that copy and be lost (torch.optim loses them the same way; the Trainer refuses such a model)."""
    n = sum(1 for p in params if p.requires_grad and p.is_meta)
    if n:
        raise ValueError(
            f"{owner}: {n} trainable parameters are on the meta device (offloaded by accelerate: device_map with CPU "
            "or disk offload, cpu_offload, disk_offload; or created under init_empty_weights and never loaded). "
            "Each forward loads an offloaded weight into a temporary copy, so its gradient and update would be lost. "
            "Load the model with every trainable weight in memory (device_map without offload, or a smaller model / "
            "LoRA), or freeze the offloaded part.")


def refuse_distributed(model: nn.Module) -> None:
    wrapped = type(model).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel") or any(
        type(m).__name__ in ("FullyShardedDataParallel", "FSDPModule") for m in model.modules()
    )
    if wrapped or (torch.distributed.is_available() and torch.distributed.is_initialized()
                   and torch.distributed.get_world_size() > 1):
        raise ValueError(
            "FORGE optimizers do not support distributed training yet (DDP/FSDP/DeepSpeed): each rank would apply "
            "its local, un-reduced gradient tiles. Train on one device, or use torch.optim.AdamW."
        )


RESULT_OPTIONS = ("amsgrad", "maximize", "capturable", "differentiable")  # torch.optim options FORGE does not have


def check_torch_options(owner: str, options: dict[str, Any], hyperparameters: tuple[str, ...] = ()) -> None:
    """``torch.optim`` keywords: implementation choices (``foreach``, ``fused``) are accepted (FORGE has its own
    kernels); options that would change the result are refused when set. ``hyperparameters``: the optimizer's own,
    named in the error for an unknown keyword (a misspelt ``momentum``)."""
    for key, value in options.items():
        if key in ("foreach", "fused"):
            continue
        if key in RESULT_OPTIONS:
            if value:
                raise ValueError(f"{owner} does not support {key}=True (torch.optim's option); use torch.optim for it.")
            continue
        own = f"its hyperparameters are {', '.join(hyperparameters)}; " if hyperparameters else ""
        raise TypeError(
            f"{owner} got an unexpected keyword argument {key!r}; {own}its FORGE options are max_grad_norm, clip, "
            "clip_pass, state_dtype, stochastic_rounding, tile_bytes, head_grad, kernel (see its docstring)."
        )


def check_hp(lr: float, betas: tuple[float, float], eps: float, wd: float) -> None:
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0; got {lr}.")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1); got {betas}.")
    if not eps >= 0 or not wd >= 0:
        raise ValueError(f"eps and weight_decay must be >= 0; got eps={eps}, weight_decay={wd}.")

