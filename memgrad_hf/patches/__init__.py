"""How models are changed: the generic chunked-head patch, Titans injection, FORGE's linear swap.

Nothing here does arithmetic; the math lives in :mod:`memgrad_hf.kernels` behind :mod:`memgrad_hf.functional`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from memgrad_hf.errors import UnsupportedModelError
from memgrad_hf.patches.head import is_head_patched, patch_head, unpatch_head
from memgrad_hf.patches.trainer import hook_trainer_compute_loss, hook_trainer_init
from memgrad_hf.patches.unwrap import base_model

logger = logging.getLogger(__name__)

hook_trainer_compute_loss()  # Trainer's label smoothing runs through the chunked head of a patched model
hook_trainer_init()  # a TRL trainer built around a patched model installs memgrad's fused head


def patch_model(
    model: nn.Module,
    *,
    head: bool = True,
    titans: Any = None,
    chunk_size: int | None = None,
    accum_dtype: torch.dtype | None = None,
    grad_in_forward: bool | None = None,
) -> nn.Module:
    """Patch a transformers ``*ForCausalLM`` (or ``*ForMaskedLM``, an encoder-decoder's
    ``*ForConditionalGeneration``, a PEFT model around one) in place and return it.

    Args:
        head: chunked LM head — in training forwards with ``labels`` the ``[tokens x vocab]`` logits are never
            built; the loss and every gradient equal HF's. ``outputs.logits`` is ``None`` for those calls;
            ``model.eval()`` forwards and ``generate`` are unchanged. Pass ``skip_logits=True/False`` to a forward
            to force the choice. ``head=False`` on a model patched before removes the chunked head.
        titans: a :class:`memgrad_hf.titans.TitansConfig`: adds a gated Titans memory branch to the chosen decoder
            layers (outputs identical at step 0; memory state follows the KV cache in ``generate``; saved by
            ``save_pretrained``, loaded by :func:`memgrad_hf.titans.from_pretrained`).
        chunk_size: tokens per head chunk (default: automatic).
        accum_dtype: head weight-gradient accumulator dtype (default fp32; the weight's dtype saves memory).
        grad_in_forward: ``False`` recomputes the head's logits in backward instead of computing its gradients in
            forward: a third more head flops, and no fp32 ``[vocab x hidden]`` weight-gradient buffer for a bf16
            model (on an H100 at vocab 128256, hidden 1024: 0.53x the head's memory at 1.02x its time; at 32768,
            1.58x the time; the extra GEMM grows with the hidden size, the buffer's traffic does not). ``None``
            (default): in forward on the GPU's Triton head and for fp32 models, else recomputed.
            Under a FORGE optimizer its own ``head_grad`` option decides.

    Example::

        import memgrad_hf, torch
        from transformers import AutoModelForCausalLM, LlamaConfig
        model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                                             num_hidden_layers=2, num_attention_heads=4))
        model = memgrad_hf.patch_model(model)        # or AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B")
        ids = torch.randint(0, 1000, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss   # same loss and gradients, no logits tensor

    Raises:
        UnsupportedModelError: the model lacks what the patch needs (the message names the class and what).
        ValueError: a bad argument (the message says the fix).
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"patch_model expects a torch.nn.Module; got {type(model).__name__}.")
    if not head:
        if titans is None and not is_head_patched(base_model(model)):  # a no-op: warned (a script may pass its
            # flags through), not refused
            logger.warning("patch_model(head=False) without titans= changes nothing: pass titans=TitansConfig(...) "
                           "to add only the Titans memory, or head=True for the chunked head.")
        ignored = [k for k, v in (("chunk_size", chunk_size), ("accum_dtype", accum_dtype),
                                  ("grad_in_forward", grad_in_forward)) if v is not None]
        if ignored:
            logger.warning(f"patch_model(head=False): {', '.join(ignored)} configure the chunked head, which "
                           "head=False leaves out, and are ignored; drop them or pass head=True.")
    target = base_model(model)
    if titans is not None:  # first: a bad Titans argument raises before anything is changed
        from memgrad_hf.patches.titans import inject_titans, remove_titans

        inject_titans(target, titans)
        if target is not model:
            logger.warning(
                "patch_model(titans=...) on a PEFT model: the new memory trains, but PeftModel.save_pretrained and "
                "Trainer checkpoints save the adapters only, so it would be lost (a resumed run restarts it). Patch "
                "the base model first, then wrap it with LoraConfig(modules_to_save=['titans_memory']); or save the "
                "memory with memgrad_hf.titans.save_titans(model, dir)."
            )
    try:
        if head:
            patch_head(target, chunk_size=chunk_size, accum_dtype=accum_dtype, grad_in_forward=grad_in_forward)
        elif unpatch_head(target):  # (what the chunked head's errors at forward advise, on a model patched before)
            logger.info("patch_model(head=False): the chunked head patched earlier is removed; the model's own head "
                        "runs.")
    except BaseException:
        if titans is not None:
            remove_titans(target)
        raise
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model` exactly; a model that was never patched is returned unchanged.

    Example::

        memgrad_hf.unpatch_model(model)   # the chunked head and any Titans memory removed; the original forward back
    """
    target = base_model(model)
    unpatch_head(target)
    from memgrad_hf.patches.titans import remove_titans

    remove_titans(target)
    return model


__all__ = ["patch_model", "unpatch_model", "is_head_patched", "UnsupportedModelError"]
