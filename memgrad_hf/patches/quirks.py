"""Per-family logit rewrites read from a model's config (transformers 5.x).

memgrad's own paths do not need this table: ``patch_model`` and the fused head for TRL both observe what the model's
forward does to the logits (see :mod:`memgrad_hf.patches.probe`), so a family missing here is still handled. The
table is for code that calls the backbone directly and never runs the model's head code (as TRL's own fused head
does); the test-suite checks it against the observed behaviour family by family. Direction matters: granite
divides by ``logits_scaling`` while hyperclovax multiplies by it.
"""

from __future__ import annotations

from typing import Any

from memgrad_hf.kernels.head import Epilogue

# model_type -> (config attribute, how it rewrites the logits)
QUIRKS: dict[str, tuple[tuple[str, str], ...]] = {
    "gemma2": (("final_logit_softcapping", "softcap"),),
    "gemma3_text": (("final_logit_softcapping", "softcap"),),
    "gemma3": (("final_logit_softcapping", "softcap"),),
    "gemma3n_text": (("final_logit_softcapping", "softcap"),),
    "gemma4": (("final_logit_softcapping", "softcap"),),
    "gemma4_text": (("final_logit_softcapping", "softcap"),),
    "recurrent_gemma": (("logits_soft_cap", "softcap"),),
    "xlstm": (("output_logit_soft_cap", "softcap"),),
    "nanochat": (("final_logit_softcapping", "softcap"),),
    "cohere": (("logit_scale", "multiply"),),
    "cohere2": (("logit_scale", "multiply"),),
    "cohere2_moe": (("logit_scale", "multiply"),),
    "granite": (("logits_scaling", "divide"),),
    "granitemoe": (("logits_scaling", "divide"),),
    "granitemoeshared": (("logits_scaling", "divide"),),
    "granitemoehybrid": (("logits_scaling", "divide"),),
    "hyperclovax": (("logits_scaling", "multiply"),),
    "falcon_h1": (("lm_head_multiplier", "multiply"),),
}


def epilogue_from_config(config: Any, temperature: float = 1.0) -> Epilogue:
    """The logit rewrite a model family applies after its LM head, from its (text) config.

    Example::

        from transformers import Gemma2Config
        epilogue_from_config(Gemma2Config(final_logit_softcapping=30.0))  # Epilogue(inp=1/30, tanh=True, out=30)
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale, cap = 1.0, None
    for attr, kind in QUIRKS.get(getattr(text, "model_type", ""), ()):
        value = getattr(text, attr, None)
        if value is None:
            continue
        if kind == "softcap":
            cap = float(value) if value else None
        elif kind == "multiply":
            scale *= float(value)
        elif kind == "divide":
            scale /= float(value)
    return Epilogue.make(logit_scale=scale, softcap=cap, temperature=temperature)
