"""The transformers model under a wrapper (what every patch and loader works on), and memgrad's own wrappers of a
model's ``forward``."""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (``PeftModel.get_base_model()``), else ``model`` itself.

    Example::

        base_model(get_peft_model(model, LoraConfig(...))) is model   # True (the LoRA layers sit inside it)
    """
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and type(model).__module__.startswith("peft"):
        return get_base()
    return model


def present_as_forward(wrapper: Any, model: nn.Module) -> None:
    """Give ``wrapper`` (a function to bind to ``model`` as its instance ``forward``) the class forward's name, doc and
    signature, so that ``inspect.signature(model.forward)`` is the class's (``generate()`` and the Trainer's column
    dropping read it); its ``__module__`` stays memgrad's (a warning naming who wrapped a forward reads it).

    Not through ``__wrapped__``: ``Accelerator.unwrap_model(keep_fp32_wrapper=False)`` follows ``__wrapped__`` down
    from the forward it finds and stops only at the one it saved before its autocast wrapper, which is bound and so
    never equal to a function: given a ``__wrapped__``, it walked past memgrad's wrapper to the class's forward and
    dropped it (the chunked head and FORGE's exact clipping were lost without a word). Except where that autocast
    wrapper is already inside (the model was prepared first): then accelerate binds whatever its walk ends at, and
    a bound wrapper without ``__wrapped__`` would be bound twice; its walk must end at the class's forward (memgrad's
    wrapper is then dropped, and says so where it matters)."""
    cls_forward = type(model).forward
    functools.update_wrapper(wrapper, cls_forward, assigned=("__name__", "__qualname__", "__doc__"), updated=())
    wrapper.__signature__ = inspect.signature(cls_forward)
    if "_original_forward" not in model.__dict__:  # (else accelerate's mixed-precision wrapper is on the model already)
        del wrapper.__wrapped__  # (update_wrapper sets it)
