"""The transformers model under a wrapper: what every patch and loader works on."""

from __future__ import annotations

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
