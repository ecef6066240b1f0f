"""Make ``optim="forge_adamw"`` / ``"forge_lion"`` / ``"forge_sgd"`` valid Trainer choices (``TrainingArguments``
and the CLI).

transformers has no registration API: real ``OptimizerNames`` members are added (so ``to_dict``/JSON/pickle and
``HfArgumentParser`` choices work) and a handler is put in the Trainer's handler table. Parsers built before
``import memgrad_hf`` keep their old choices, so import it first.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

log = logging.getLogger("memgrad_hf.forge")

NAMES = {"FORGE_ADAMW": "forge_adamw", "FORGE_LION": "forge_lion", "FORGE_SGD": "forge_sgd"}


def _add_member(enum_cls: Any, name: str, value: str) -> Any:
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    type.__setattr__(enum_cls, name, member)  # EnumType.__setattr__ refuses to add members
    # pickled (a checkpoint's training_args.bin) as a call of ours, not OptimizerNames(value): unpickling then
    # imports memgrad_hf, which registers the name, where OptimizerNames("forge_adamw") alone would be refused
    member.__reduce_ex__ = functools.partial(_reduce_member, value)
    return member


def _reduce_member(value: str, protocol: int) -> tuple[Any, tuple[str]]:
    return optimizer_name, (value,)


def optimizer_name(value: str) -> Any:
    """The registered ``OptimizerNames`` member ``value`` (``"forge_adamw"``, ...): how a pickled one is loaded."""
    from transformers.training_args import OptimizerNames

    register()
    return OptimizerNames(value)


def _parse_bool(v: str, key: str = "") -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"optim_args {key or 'value'} must be true or false (also 1/0, yes/no, on/off); got {v!r}.")


def _parse_float(key: str, v: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"optim_args {key} must be a number such as 0.9; got {v!r}.") from None


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30}


def _parse_bytes(v: str) -> int:
    """``"4194304"``, ``"4MiB"``, ``"64MB"``, ``"1GiB"`` -> bytes."""
    text = v.strip().lower()
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text[len(digits):].strip()
    try:
        return int(float(digits) * _UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"tile_bytes in optim_args must be a number of bytes such as 4194304, 4MiB or 64MB; "
                         f"got {v!r}.") from None


# hyperparameters users try in optim_args, and the TrainingArguments that set them
_TRAINER_HPARAMS = {
    **dict.fromkeys(("lr", "learning_rate"), "--learning_rate (TrainingArguments(learning_rate=...))"),
    "weight_decay": "--weight_decay (TrainingArguments(weight_decay=...))",
    **dict.fromkeys(("betas", "beta1", "beta2", "adam_beta1", "adam_beta2"),
                    "--adam_beta1 / --adam_beta2 (TrainingArguments(adam_beta1=..., adam_beta2=...); forge_lion "
                    "reads its betas from them too)"),
    **dict.fromkeys(("eps", "epsilon", "adam_epsilon"), "--adam_epsilon (TrainingArguments(adam_epsilon=...))"),
}
_ADAM_ONLY = ("betas", "beta1", "beta2", "adam_beta1", "adam_beta2", "eps", "epsilon", "adam_epsilon")  # not SGD's


def _handler(ctx: Any) -> tuple[Any, dict[str, Any]]:
    from memgrad_hf.optim.forge import ForgeAdamW, ForgeLion, ForgeSGD
    from memgrad_hf.optim.forge_checks import OPTION_CHOICES, parse_state_dtype

    args = ctx.args
    name = str(getattr(args.optim, "value", args.optim))
    _check_trainer_args(args, name)
    kwargs = dict(ctx.optimizer_kwargs)
    cls = {"forge_adamw": ForgeAdamW, "forge_lion": ForgeLion, "forge_sgd": ForgeSGD}[name]
    if cls is ForgeAdamW:
        kwargs.update(ctx.adam_kwargs)
    elif cls is ForgeLion:
        kwargs["betas"] = (args.adam_beta1, args.adam_beta2)
    kwargs["forge_model"] = ctx.model
    kwargs["_trainer_managed"] = True  # (the root and exact clipping hook into Accelerator.backward)
    kwargs["max_grad_norm"] = float(args.max_grad_norm or 0.0)
    for key, value in (ctx.optim_args or {}).items():
        key = key.strip().lower()
        if key in OPTION_CHOICES:
            kwargs[key] = value.strip().lower()
            if kwargs[key] not in OPTION_CHOICES[key]:
                raise ValueError(f"optim_args {key} must be one of {OPTION_CHOICES[key]}; got {value!r}.")
        elif key == "tile_bytes":
            kwargs["tile_bytes"] = _parse_bytes(value)
        elif key == "max_grad_norm":
            raise ValueError(
                f"optim_args max_grad_norm: {name} takes the Trainer's own max_grad_norm; set --max_grad_norm "
                f"{value} (TrainingArguments(max_grad_norm={value})) instead."
            )
        elif key in ("stochastic_rounding", "bf16_stochastic_round"):
            kwargs["stochastic_rounding"] = _parse_bool(value, key)
        elif key == "state_dtype":
            try:
                parse_state_dtype(value)
            except ValueError as e:
                raise ValueError(f"optim_args {e}") from None
            kwargs["state_dtype"] = value
        elif cls is ForgeSGD and key in ("momentum", "dampening"):
            kwargs[key] = _parse_float(key, value)
        elif cls is ForgeSGD and key == "nesterov":
            kwargs["nesterov"] = _parse_bool(value, key)
        elif cls is ForgeLion and key in ("eps", "epsilon", "adam_epsilon"):
            raise ValueError(f"optim_args {key}: {name} has no epsilon (Lion steps by the sign of its update); "
                             "remove it.")
        elif key in _TRAINER_HPARAMS and not (cls is ForgeSGD and key in _ADAM_ONLY):
            raise ValueError(
                f"optim_args {key}: {name} takes this from the Trainer's own arguments, as adamw_torch does; set "
                f"{_TRAINER_HPARAMS[key]} instead."
            )
        else:
            raise ValueError(
                f"optim_args key {key!r} is not understood by {name}; supported: clip=exact|previous, "
                "clip_pass=auto|replay|backward, "
                "stochastic_rounding=true|false, state_dtype=auto|fp32|bf16|8bit, tile_bytes=N, "
                "head_grad=auto|recompute|hold, kernel=auto|fused|split"
                + ("; momentum=F, dampening=F, nesterov=true|false." if cls is ForgeSGD else ".")
            )
    if getattr(args, "auto_find_batch_size", False) and not (kwargs["max_grad_norm"] > 0
                                                             and kwargs.get("clip", "exact") == "exact"):
        log.warning(
            "optim=%s with auto_find_batch_size=True but without exact clipping (max_grad_norm=%s, clip=%s): an "
            "out-of-memory error inside backward leaves the layers whose backward had run updated before the Trainer "
            "retries with a smaller batch. Set max_grad_norm > 0 with clip=exact (the norm is measured before any "
            "update, so a failed attempt changes nothing) or a batch size that fits.",
            name, kwargs["max_grad_norm"], kwargs.get("clip", "exact"))
    if kwargs["max_grad_norm"] > 0 and kwargs.get("clip") == "previous":  # training differs from stock: warned
        log.warning("%s: max_grad_norm=%s is applied approximately, with the previous step's norm (optim_args "
                    "clip=previous; the first step is not clipped). Remove clip=previous for exact clipping, or set "
                    "max_grad_norm=0 to skip clipping.", name, kwargs["max_grad_norm"])
    elif kwargs["max_grad_norm"] > 0:  # the Trainer's default, and stock's result: what it costs is information
        log.info("%s: max_grad_norm=%s is applied exactly (the norm is measured before any update: weight-gradient "
                 "tiles are kept for the updates where they fit under the peak memory so far, else formed twice; with "
                 "clip_pass=backward and by default under gradient checkpointing, the whole backward runs twice; "
                 "optim_args='clip=previous' uses the previous step's norm instead). Set max_grad_norm=0 to skip "
                 "clipping.", name, kwargs["max_grad_norm"])
    return cls, kwargs


def _check_trainer_args(args: Any, name: str) -> None:
    if getattr(args, "fp16", False):
        raise ValueError(
            f"optim={name} cannot be used with fp16=True: the update happens inside backward, before the GradScaler "
            "can check for overflow. Use bf16=True (no loss scaling needed) or another optimizer."
        )
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None) or getattr(args, "world_size", 1) > 1:
        raise ValueError(
            f"optim={name} does not support distributed training yet (DDP/FSDP/DeepSpeed): each rank would update "
            "with its local, un-reduced gradient tiles. Train on one device or use adamw_torch."
        )


def register() -> None:
    """Idempotent; called by ``import memgrad_hf``."""
    from transformers import trainer_optimizer
    from transformers.training_args import OptimizerNames

    for name, value in NAMES.items():
        member = _add_member(OptimizerNames, name, value)
        trainer_optimizer._OPTIMIZER_HANDLERS[member] = _handler
    _register_callback()
    _hook_accelerator_backward()
    _hook_torch_clip()
    _hook_trainer_train()
    _hook_optim_args_parser()
    _hook_grad_scaler()


def _hook_grad_scaler() -> None:
    """A ``GradScaler`` on a loss that reaches an attached FORGE optimizer's layers is refused at ``scaler.scale``:
    FORGE applies each update inside that loss's backward, so the weights would move by the scaled gradient
    (65536x) before the scaler could unscale or skip anything."""
    import torch

    original = torch.amp.GradScaler.scale
    if getattr(original, "_memgrad_forge", False):
        return

    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        from memgrad_hf.optim.forge import ForgeOptimizer

        # an attached optimizer whose layers ran a forward not yet back-propagated: this loss reaches them
        busy = [o for o in list(ForgeOptimizer._attached_now) if any(o._pending(w) for w in list(o._last_use))]
        if self.is_enabled() and busy:
            opt = busy[0]
            raise ValueError(
                f"A GradScaler with {type(opt).__name__} (attached to {type(opt.model).__name__}): FORGE applies the "
                "update inside backward, so the scaled gradient would reach the weights before the scaler could "
                "unscale it. Remove the GradScaler: bf16 autocast needs none (fp16 is not supported with FORGE)."
            )
        return original(self, outputs)

    scale._memgrad_forge = True  # type: ignore[attr-defined]
    torch.amp.GradScaler.scale = scale


def _hook_optim_args_parser() -> None:
    """transformers splits ``optim_args`` on ',' and '=' and fails with a bare unpacking error on an entry that is
    not ``key=value`` (``optim_args="clip"``): the same parse, with an error that says what is wrong."""
    import transformers.trainer as trainer_mod

    original = trainer_mod._parse_optim_args
    if getattr(original, "_memgrad_forge", False):
        return

    @functools.wraps(original)
    def parse(optim_args: str | None) -> dict[str, str]:
        try:
            return original(optim_args)
        except ValueError:
            bad = [m for m in str(optim_args).replace(" ", "").split(",") if m.count("=") != 1]
            raise ValueError("optim_args must be comma-separated key=value pairs (e.g. 'clip=exact,state_dtype=bf16'); "
                             f"got {optim_args!r}, where {bad} are not key=value.") from None

    parse._memgrad_forge = True  # type: ignore[attr-defined]
    trainer_mod._parse_optim_args = parse


def _hook_trainer_train() -> None:
    """``Trainer.train`` detaches its FORGE optimizer when it stops on an exception (Ctrl-C, an error in a callback):
    ``on_train_end`` does not run then, and a FORGE optimizer left attached would go on updating the model inside
    every later backward (another Trainer's, an evaluation's gradients). A new ``train()`` attaches it again."""
    from transformers import Trainer

    original = Trainer.train
    if getattr(original, "_memgrad_forge", False):
        return

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        from memgrad_hf.callbacks.forge import ForgeLogCallback

        handler = getattr(self, "callback_handler", None)
        for cb in getattr(handler, "callbacks", ()):
            if isinstance(cb, ForgeLogCallback):  # (it checks the others once the optimizer is known)
                cb.others = [c for c in handler.callbacks if c is not cb]
        _warn_forge_overridden(self)
        try:
            return original(self, *args, **kwargs)
        except BaseException:
            from memgrad_hf.optim.forge import forge_optimizer_of

            opt = forge_optimizer_of(getattr(self, "optimizer", None))
            if opt is not None and opt._attached:
                opt.end_trainer()
            raise

    train._memgrad_forge = True  # type: ignore[attr-defined]
    Trainer.train = train


def _warn_forge_overridden(trainer: Any) -> None:
    """``optim="forge_*"`` while the Trainer was given an optimizer of the caller's (``optimizers=(opt, sched)`` or
    ``optimizer_cls_and_kwargs``): the Trainer then ignores ``args.optim``, as for every name, so FORGE would never
    run and nothing said so."""
    from memgrad_hf.optim.forge import ForgeOptimizer, forge_optimizer_of

    optim = getattr(getattr(trainer, "args", None), "optim", None)
    name = getattr(optim, "value", optim)
    if name not in NAMES.values():
        return
    given, cls_kwargs = getattr(trainer, "optimizer", None), getattr(trainer, "optimizer_cls_and_kwargs", None)
    if given is not None:
        if forge_optimizer_of(given) is not None:
            return
        what = f"optimizers=({type(getattr(given, 'optimizer', given)).__name__}, ...)"
    elif cls_kwargs is not None:
        cls = cls_kwargs[0]
        if isinstance(cls, type) and issubclass(cls, ForgeOptimizer):
            return
        what = f"optimizer_cls_and_kwargs=({getattr(cls, '__name__', cls)}, ...)"
    else:
        return
    log.warning("optim=%s is ignored: the Trainer was given %s, which it uses instead of args.optim, so FORGE does not "
                "run (every weight gradient is held until step(), as usual). Drop that argument, or build the "
                "optimizer with memgrad_hf.optim.ForgeAdamW (e.g. peft's create_loraplus_optimizer(model, ForgeAdamW, "
                "lr=..., loraplus_lr_ratio=16, forge_model=model)).", name, what)


def _hook_accelerator_backward() -> None:
    """``Accelerator.backward(loss)`` gives ``loss`` the root of a prepared, attached FORGE optimizer (the norm pass
    of exact clipping first, gradients that arrive in parts applied once), whatever computed the loss (the model,
    TRL's GRPO loss, a custom ``compute_loss``, your own loop's). A no-op for every other optimizer."""
    from accelerate import Accelerator

    original = Accelerator.backward
    if getattr(original, "_memgrad_forge", False):
        return

    def backward(self: Any, loss: Any, **kwargs: Any) -> Any:
        from memgrad_hf.optim.forge import forge_optimizer_of

        for o in getattr(self, "_optimizers", ()):
            inner = forge_optimizer_of(o)
            if inner is not None and inner._attached:
                inner.scan_uses(loss)
                loss = inner.clip_root(loss)
        return original(self, loss, **kwargs)

    backward._memgrad_forge = True  # type: ignore[attr-defined]
    backward.__doc__ = original.__doc__
    Accelerator.backward = backward

    original_clip = Accelerator.clip_grad_norm_

    @functools.wraps(original_clip)
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        from memgrad_hf.optim.forge import forge_optimizer_of

        for o in getattr(self, "_optimizers", ()):
            inner = forge_optimizer_of(o)
            if inner is not None:
                _warn_clip_does_nothing(inner, max_norm, "accelerator.clip_grad_norm_", _norm_type(args, kwargs))
        return original_clip(self, parameters, max_norm, *args, **kwargs)

    Accelerator.clip_grad_norm_ = clip_grad_norm_


def _warn_clip_does_nothing(opt: Any, max_norm: float, caller: str, norm_type: Any = 2.0) -> None:
    """Once per optimizer: a clip call in a hand-written loop finds no ``.grad`` to clip (FORGE applied each update
    inside backward), unless the optimizer itself clips at that norm. The Trainer's own call clips through FORGE."""
    two = float(norm_type) == 2.0
    exact = opt.max_grad_norm == max_norm and opt.clip != "previous" and two  # (the call returns the measured norm)
    if opt._trainer_managed or not max_norm or not math.isfinite(max_norm) or exact or opt._clip_call_warned:
        return
    opt._clip_call_warned = True
    if not two:
        log.warning(
            "%s(max_norm=%s, norm_type=%s) does nothing with %s: the update was applied inside backward, and no .grad "
            "is left to clip (it returns 0). FORGE clips by the global 2-norm only (its max_grad_norm); to clip by the "
            "%s-norm, train with a torch optimizer.", caller, max_norm, norm_type, type(opt).__name__, norm_type)
        return
    log.warning(
        "%s(max_norm=%s) does nothing with %s: the update was applied inside backward, and no .grad is left to clip "
        "(it returns 0). Construct the optimizer with max_grad_norm=%s (exact clipping, before any update) instead; "
        "optimizer.last_grad_norm holds the measured norm.", caller, max_norm, type(opt).__name__, max_norm)


def _norm_type(args: tuple, kwargs: dict) -> Any:
    """The ``norm_type`` of a ``clip_grad_norm_(parameters, max_norm, norm_type=2.0, ...)`` call."""
    return args[0] if args else kwargs.get("norm_type", 2.0)


def _measured_norm(opt: Any, parameters: list, max_norm: float, args: tuple, kwargs: dict) -> float | None:
    """The 2-norm ``opt`` measured this step, where it clips exactly at ``max_norm`` over every trainable one of
    ``parameters``; else None."""
    if (float(_norm_type(args, kwargs)) != 2.0 or not opt.max_grad_norm or opt.max_grad_norm != max_norm
            or opt.clip == "previous" or opt.last_grad_norm is None
            or not opt._is_sync()):  # (a non-sync micro-batch's sum is in .grad)
        return None
    if {p for p in parameters if p.requires_grad} != {p for p in opt._group_index if p.requires_grad}:
        return None  # a part of the model: FORGE's norm is over all of it
    return float(opt.last_grad_norm)


def _hook_torch_clip() -> None:
    """``torch.nn.utils.clip_grad_norm_`` over parameters of an attached FORGE optimizer, the usual idiom of a
    hand-written loop, silently clips nothing (no ``.grad`` exists): said once, with the fix."""
    import torch

    original = torch.nn.utils.clip_grad_norm_
    if getattr(original, "_memgrad_forge", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        measured = None
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for opt in _forge_owners(parameters):  # (the warning is said inside, by _clip_grads_with_norm_ below,
            if measured is None:  # which does not see the norm type: a norm other than 2 is warned about here)
                measured = _measured_norm(opt, parameters, max_norm, args, kwargs)
            if float(_norm_type(args, kwargs)) != 2.0:
                _warn_clip_does_nothing(opt, max_norm, "torch.nn.utils.clip_grad_norm_", _norm_type(args, kwargs))
        total = original(parameters, max_norm, *args, **kwargs)
        # the optimizer clipped exactly at this norm in backward: the call's usual result is the norm it measured
        # (the loop that logs it would log 0: no .grad is left)
        return total if measured is None else total.new_tensor(measured)

    clip_grad_norm_._memgrad_forge = True  # type: ignore[attr-defined]
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_

    # torch's clip_grad_norm_ under any other name (imported before memgrad_hf, or from torch.nn.utils.clip_grad)
    # reaches the module's _clip_grads_with_norm_ by its global name: the warning is said there too
    from torch.nn.utils import clip_grad as module

    clip_with_norm = module._clip_grads_with_norm_

    @functools.wraps(clip_with_norm)
    def _clip_grads_with_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)  # (a generator once)
        for opt in _forge_owners(parameters):
            _warn_clip_does_nothing(opt, max_norm, "torch.nn.utils.clip_grad_norm_")
        return clip_with_norm(parameters, max_norm, *args, **kwargs)

    module._clip_grads_with_norm_ = _clip_grads_with_norm_

    clip_value = torch.nn.utils.clip_grad_value_

    @functools.wraps(clip_value)
    def clip_grad_value_(parameters: Any, clip_value_: float, *args: Any, **kwargs: Any) -> Any:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for opt in _forge_owners(parameters):
            raise ValueError(
                f"torch.nn.utils.clip_grad_value_ cannot clip the gradients of {type(opt).__name__}'s parameters: "
                "the update is applied inside backward, and no .grad is left to clip. FORGE clips by the global "
                "norm only: remove the call, or construct the optimizer with max_grad_norm=... (exact clipping).")
        return clip_value(parameters, clip_value_, *args, **kwargs)

    torch.nn.utils.clip_grad_value_ = module.clip_grad_value_ = clip_grad_value_


def _forge_owners(parameters: Any) -> list:
    """The attached FORGE optimizers that update any of ``parameters`` (a list or tensor; none if none attached)."""
    import torch

    from memgrad_hf.optim.forge import ForgeOptimizer

    if not ForgeOptimizer._attached_now:  # (a WeakSet: empty unless some FORGE optimizer is attached)
        return []
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [opt for opt in list(ForgeOptimizer._attached_now) if any(p in opt._group_index for p in parameters)]


def _register_callback() -> None:
    """Every Trainer gets :class:`ForgeLogCallback` (a no-op unless the optimizer is a FORGE one)."""
    import transformers.trainer as trainer_mod

    from memgrad_hf.callbacks.forge import ForgeLogCallback

    if not any(c is ForgeLogCallback for c in trainer_mod.DEFAULT_CALLBACKS):
        trainer_mod.DEFAULT_CALLBACKS.append(ForgeLogCallback)
