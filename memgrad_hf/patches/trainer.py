"""The chunked head under HF ``Trainer``: label smoothing in training, and loss-only evaluation.

``label_smoothing_factor > 0``: stock ``Trainer.compute_loss`` takes the labels out of the batch, asks the model for
full logits and applies ``LabelSmoother`` to them: the ``[tokens x vocab]`` logits (and their log-softmax) exist
again. For a ``patch_model``ed causal LM (or masked LM, on its unshifted labels), memgrad keeps the labels in the
batch and has the chunked head compute the same loss, cross-entropy with label smoothing ε (``LabelSmoother``'s
formula is ``F.cross_entropy``'s: ``(1-ε)·nll + ε·mean_c(-log p_c)``, summed over the valid tokens and divided by
``num_items_in_batch``).

``prediction_loss_only`` evaluation: the logits would be thrown away, so the patched model computes the loss in
chunks (``skip_logits=True``, as the Trainer already asks Liger's models to) and never builds them.

Everything else (evaluation that returns logits, ``compute_loss_func``, models that are not patched, subclasses that
compute their own loss) goes through the stock methods unchanged.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
from torch import nn

from memgrad_hf.patches.unwrap import base_model

logger = logging.getLogger(__name__)


def _patched_lm(trainer: Any, model: nn.Module) -> nn.Module | None:
    """The head-patched causal or masked LM behind ``model`` (where the stock method smooths shifted labels, or
    unshifted ones, as the model's own loss takes them), else None."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    from memgrad_hf.patches.head import is_head_patched

    target = base_model(trainer.accelerator.unwrap_model(model))
    names = {*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values(), *MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()}
    if not is_head_patched(target) or target._get_name() not in names:
        return None
    return target


def _refuse_liger_head(trainer: Any, model: nn.Module) -> None:
    """``use_liger_kernel=True`` with Liger's fused linear cross-entropy (its default) replaces a patched model's
    ``forward`` at ``train()``: memgrad's chunked head (and a FORGE optimizer's hand-over of the head gradient) would
    silently stop running. Refused before the first step."""
    from memgrad_hf.patches.head import is_head_patched

    config = getattr(trainer.args, "liger_kernel_config", None) or {}
    if not config.get("fused_linear_cross_entropy", True):
        return
    target = base_model(trainer.accelerator.unwrap_model(model))
    if is_head_patched(target):
        raise ValueError(
            f"use_liger_kernel=True replaces {type(target).__name__}.forward with Liger's fused linear cross-entropy, "
            "which discards memgrad_hf's chunked head on this patch_model()ed model. Use one of them: drop "
            "use_liger_kernel, or keep Liger's other kernels with liger_kernel_config={'fused_linear_cross_entropy': "
            "False}, or patch_model(model, head=False)."
        )


def _uses_loss_function(model: nn.Module) -> bool:
    """Whether the model's forward computes its loss through ``self.loss_function`` (transformers' causal LMs), not
    an ``nn.CrossEntropyLoss`` of its own on unshifted labels (the decoders of bart, whisper, ...)."""
    code = getattr(inspect.unwrap(type(model).forward), "__code__", None)
    return code is None or "loss_function" in code.co_names


def hook_trainer_compute_loss() -> None:
    """Idempotent; called by ``import memgrad_hf``."""
    from transformers import Trainer

    original = Trainer.compute_loss
    if getattr(original, "_memgrad_head", False):
        return
    original_prediction_step = Trainer.prediction_step

    @functools.wraps(original)
    def compute_loss(self: Any, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if getattr(self.args, "use_liger_kernel", False):
            _refuse_liger_head(self, model)
        training = model.training and torch.is_grad_enabled()
        loss_only = not model.training and getattr(self, "_memgrad_loss_only", False)
        target = None
        if (training or loss_only) and "labels" in inputs and self.compute_loss_func is None:
            target = _patched_lm(self, model)
        if target is None:
            return original(self, model, inputs, *args, **kwargs)
        smoother = self.label_smoother
        # (only where the model keeps its labels: where the smoother takes them, full logits are what it needs)
        with_skip = {**inputs, "skip_logits": True} if loss_only else inputs
        if smoother is None:
            return original(self, model, with_skip, *args, **kwargs)
        # The same normalization on both paths needs the model to receive num_items_in_batch
        # (model_accepts_loss_kwargs): otherwise the stock path divides by the whole batch's count, the model's loss
        # by the micro-batch's.
        if not self.model_accepts_loss_kwargs or getattr(smoother, "ignore_index", -100) != -100:
            return original(self, model, inputs, *args, **kwargs)  # labels popped by the smoother, full logits
        if not _uses_loss_function(target):
            if not getattr(self, "_memgrad_own_ce_warned", False):
                self._memgrad_own_ce_warned = True
                logger.warning(
                    "%s computes its own cross-entropy (not through self.loss_function), which Trainer's "
                    "label_smoothing_factor replaces by smoothing full logits: those are built as stock Trainer "
                    "builds them (no memory saving for this loss). Without label smoothing the chunked head serves "
                    "it.", type(target).__name__)
            return original(self, model, inputs, *args, **kwargs)
        from memgrad_hf.patches.head import head_label_smoothing

        self.label_smoother = None  # the stock method then leaves the labels in and returns the model's loss
        try:
            with head_label_smoothing(target, smoother.epsilon):
                return original(self, model, with_skip, *args, **kwargs)
        finally:
            self.label_smoother = smoother

    @functools.wraps(original_prediction_step)
    def prediction_step(self: Any, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        *args: Any, **kwargs: Any) -> Any:
        self._memgrad_loss_only = bool(prediction_loss_only)
        try:
            return original_prediction_step(self, model, inputs, prediction_loss_only, *args, **kwargs)
        finally:
            self._memgrad_loss_only = False

    compute_loss._memgrad_head = True  # type: ignore[attr-defined]
    Trainer.compute_loss = compute_loss
    Trainer.prediction_step = prediction_step


def _is_trl_trainer(trainer: Any) -> bool:
    return any(cls.__module__.startswith("trl.") for cls in type(trainer).__mro__)


def hook_trainer_init() -> None:
    """Idempotent; called by ``import memgrad_hf``. TRL loads a trainer's module on first use (``from trl import
    GRPOTrainer``), often after ``patch_model``: when a TRL trainer is built around a patched model, the fused head its
    ``__init__`` installs next (after ``Trainer.__init__``) becomes memgrad's, whatever the import order; around a model
    with Titans memory, its reference model gets the memory (``memgrad_hf.grpo.fused_head._dispatch``)."""
    from transformers import Trainer

    original = Trainer.__init__
    if getattr(original, "_memgrad_route", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _warn_titans_dropped(self.model)
        if _is_trl_trainer(self):
            from memgrad_hf.grpo.fused_head import is_memgrad_patched, route_patched_models
            from memgrad_hf.patches.titans import is_titans_patched
            # a patched head, or a Titans memory (its reference model, loaded by TRL without it, gets it: _dispatch)
            if isinstance(self.model, nn.Module) and (is_memgrad_patched(self.model)
                                                      or is_titans_patched(base_model(self.model))):
                route_patched_models()

    __init__._memgrad_route = True  # type: ignore[attr-defined]
    Trainer.__init__ = __init__


def _warn_titans_dropped(model: Any) -> None:
    """A checkpoint saved with Titans memory (``config.memgrad_titans``) but loaded without it, by a plain
    ``from_pretrained`` (TRL's ``model="path"`` does that): the Trainer would train it without its memory and save a
    checkpoint whose config promises memory weights it does not hold. Said at the Trainer's creation."""
    from memgrad_hf.patches.titans import CONFIG_ATTR, is_titans_patched

    if not isinstance(model, nn.Module):
        return
    base = base_model(model)
    config = getattr(base, "config", None)
    if getattr(config, CONFIG_ATTR, None) is None or is_titans_patched(base):
        return
    logger.warning(
        "memgrad_hf: the model '%s' was saved with Titans memory (config.memgrad_titans) but is loaded without it (a "
        "plain from_pretrained, e.g. a TRL trainer given a path, drops the memory): it will train without its memory "
        "and save a checkpoint that memgrad_hf.titans.from_pretrained cannot load. Load it with "
        "memgrad_hf.titans.from_pretrained(path) and pass the model to the trainer; to train the model without "
        "memory, delete config.memgrad_titans first.", getattr(config, "_name_or_path", "") or type(base).__name__)
