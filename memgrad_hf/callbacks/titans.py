"""``FANDistillationCallback``: distil every Titans memory's FAN, then switch the memories to the FAN gradient."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from memgrad_hf.patches.titans import live_memories, sync_titans_config
from memgrad_hf.titans.memory import NeuralMemory

logger = logging.get_logger(__name__)


def fan_memories(model: nn.Module) -> list[NeuralMemory]:
    """Every :class:`NeuralMemory` in ``model`` that has a FAN (``fan=True``), but PEFT's frozen originals (they
    keep the base model's gradient; its trainable copies are distilled and switched)."""
    return [m for m in live_memories(model) if m.fan is not None]


class FANDistillationCallback(TrainerCallback, ExportableState):
    """Trains each memory's :class:`~memgrad_hf.titans.FAN` against the exact inner gradient for the first part of
    training, then switches every memory to ``grad_impl="fan"``: from then on no exact inner gradient is computed.

    Args:
        distill_steps: switch when ``state.global_step`` reaches this (optimizer steps).
        distill_epochs: switch at the first optimizer step where ``state.epoch >= distill_epochs`` (fractions
            switch mid-epoch: 0.5 after half of the first epoch's steps). With both given, the
            first one reached switches; with neither, the FANs distil for the whole run and never switch.
        freeze_fan_after: after the switch, stop training the FANs (``requires_grad=False``). Otherwise the outer
            loss keeps training them through the memory (they become a learned optimizer, no longer distilled).
            Frozen FANs get no gradient after the switch, so multi-GPU DDP needs ``ddp_find_unused_parameters``
            left at its default (True for transformers models without gradient checkpointing) or set to True.

    Logged in every Trainer log: ``fan_cosine`` (mean over memories of the running cosine between predicted and
    exact weight gradients; while distilling, and frozen at the switch value afterwards), ``fan_exact_grad_calls``
    (exact inner-gradient calls summed over memories), ``fan_calls`` (chunks computed with the FAN) and
    ``fan_mode`` (0 distilling, 1 switched). After the switch :attr:`cosine_at_switch`, :attr:`exact_calls_at_switch`
    and :attr:`switch_step` hold the values at that moment; :attr:`summary` has everything after training. (A run
    resumed with ``restore_callback_states_from_checkpoint=True`` gets a new instance from transformers, built from
    the saved state: read these from the one in ``trainer.callback_handler.callbacks``, not the one you passed.)

    The FAN losses reach the FANs' parameters only, scaled by ``FAN.loss_coef`` (small by default, so that they
    barely count in the Trainer's global gradient norm); the reported loss and the model's own gradients are
    unchanged. Under gradient checkpointing the recomputed forward distils again (the counters include recomputes).

    Example::

        from memgrad_hf.callbacks import FANDistillationCallback
        patch_model(model, titans=TitansConfig(layers=[1], fan=True))
        cb = FANDistillationCallback(distill_steps=200)
        Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
        print(cb.cosine_at_switch, cb.exact_calls_at_switch)   # exact_grad_calls never grow after the switch
    """

    def __init__(self, distill_steps: int | None = None, distill_epochs: float | None = None, *,
                 freeze_fan_after: bool = True) -> None:
        # 0 would switch before the FANs have learned anything (an untrained FAN's gradient); a model saved after
        # its switch already runs its FAN when loaded, without this callback
        if distill_steps is not None and (not isinstance(distill_steps, int) or isinstance(distill_steps, bool)
                                          or distill_steps < 1):
            raise ValueError(f"FANDistillationCallback: distill_steps={distill_steps!r} must be an int >= 1 (a model "
                             "loaded after its switch runs its FAN without this callback).")
        if distill_epochs is not None and (not isinstance(distill_epochs, (int, float))
                                           or not math.isfinite(distill_epochs) or distill_epochs <= 0):
            raise ValueError(f"FANDistillationCallback: distill_epochs={distill_epochs!r} must be a number > 0 (a "
                             "model loaded after its switch runs its FAN without this callback).")
        self.distill_steps, self.distill_epochs, self.freeze_fan_after = distill_steps, distill_epochs, freeze_fan_after
        self.memories: list[NeuralMemory] = []
        self._model: nn.Module | None = None
        self.switched = False
        self.switch_step: int | None = None
        self.cosine_at_switch = float("nan")
        self.exact_calls_at_switch: int | None = None
        self.summary: dict[str, Any] = {}
        # counted in a run this one resumes (TrainingArguments(restore_callback_states_from_checkpoint=True))
        self._exact_before = self._fan_before = 0
        self._restored = False
        self._recent_cosines: list[list[list[float]]] | None = None  # each memory's FAN window, when restored

    def state(self) -> dict:
        """Saved in each checkpoint (``ExportableState``): the switch and the counters, so that a run resumed with
        ``restore_callback_states_from_checkpoint=True`` reports them as the uninterrupted run does."""
        return {"args": {"distill_steps": self.distill_steps, "distill_epochs": self.distill_epochs,
                         "freeze_fan_after": self.freeze_fan_after},
                "attributes": {"switched": self.switched, "switch_step": self.switch_step,
                               "cosine_at_switch": self.cosine_at_switch,
                               "exact_calls_at_switch": self.exact_calls_at_switch,
                               "_exact_before": self.exact_grad_calls(), "_fan_before": self.fan_calls(),
                               "_recent_cosines": [m.fan.recent_cosines() for m in self.memories],
                               "_restored": True}}

    # -- helpers --------------------------------------------------------------------------------------------------
    def cosine(self) -> float:
        """Mean running FAN cosine over the memories (nan before any distillation call)."""
        vals = [c for c in (m.fan.cosine for m in self.memories) if not math.isnan(c)]
        return sum(vals) / len(vals) if vals else float("nan")

    def exact_grad_calls(self) -> int:
        return self._exact_before + sum(m.exact_grad_calls for m in self.memories)

    def fan_calls(self) -> int:
        return self._fan_before + sum(m.fan.calls for m in self.memories)

    def _switch(self, state: Any) -> None:
        self.cosine_at_switch = self.cosine()
        self.exact_calls_at_switch = self.exact_grad_calls()
        self.switch_step = state.global_step
        self._switch_memories()

    def _switch_memories(self) -> None:
        for m in self.memories:
            m.fan.distilling = False
            m.grad_impl = "fan"
            if self.freeze_fan_after:
                m.fan.requires_grad_(False)
        self.switched = True
        if self._model is not None:  # a save from here on must reload the FAN gradient
            sync_titans_config(self._model)

    def _metrics(self) -> dict[str, float]:
        cos = self.cosine_at_switch if self.switched else self.cosine()
        return {"fan_cosine": round(cos, 4), "fan_exact_grad_calls": self.exact_grad_calls(),
                "fan_calls": self.fan_calls(), "fan_mode": int(self.switched)}

    # -- Trainer events -------------------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                    **kwargs: Any) -> None:
        # FANs saved frozen (after a switch) train again while distilling: trainable before the Trainer builds its
        # optimizer, or it would leave them out (distillation then changed nothing; a resume failed to match groups)
        for m in fan_memories(model) if model is not None else []:
            m.fan.requires_grad_(True)
        if model is not None:  # (an evaluate() before train() logs their counters too)
            self.memories, self._model = fan_memories(model), model

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise ValueError("FANDistillationCallback: the Trainer passed no model to on_train_begin.")
        self.memories = fan_memories(model)
        self._model = model
        if not self.memories:
            raise ValueError("FANDistillationCallback: the model has no NeuralMemory with a FAN; build the memories "
                             "with fan=True (e.g. patch_model(model, titans=TitansConfig(..., fan=True))).")
        if getattr(args, "fp16", False):
            raise ValueError("FANDistillationCallback: fp16=True trains with a GradScaler, which scales the model's "
                             "loss but not the FANs' distillation loss: unscaling would divide the FANs' gradients by "
                             "the loss scale (they would barely learn). Use bf16=True, or fp32.")
        if self.freeze_fan_after and getattr(args, "world_size", 1) > 1 and args.ddp_find_unused_parameters is False:
            logger.warning("FANDistillationCallback: the FANs are frozen after the switch and get no gradient; DDP "
                           "with ddp_find_unused_parameters=False will stall. Set it to True.")
        self._check_optimizer(kwargs.get("optimizer"))
        if self._restored:  # counts of the run resumed from, less what these memories have counted themselves
            self._exact_before = max(0, self._exact_before - sum(m.exact_grad_calls for m in self.memories))
            self._fan_before = max(0, self._fan_before - sum(m.fan.calls for m in self.memories))
        restored_switch, self._restored = self._restored and self.switched, False
        self.switched = False
        for m in self.memories:
            if m.grad_impl == "fan":  # distillation needs the exact gradient as its target
                m.grad_impl = "manual"
            m.fan.requires_grad_(True)
            m.fan.distilling = True
            m.fan.accumulation_steps = args.gradient_accumulation_steps
            m.fan.reset_stats()
        if self._recent_cosines is not None and len(self._recent_cosines) == len(self.memories):  # (resumed)
            for m, window in zip(self.memories, self._recent_cosines, strict=True):
                m.fan.restore_cosines(window)
        self._recent_cosines = None
        sync_titans_config(model)
        if restored_switch:  # resumed after the switch: as it was, with the values recorded then
            self._switch_memories()
        elif self._due(state):  # resumed past the switch point (steps or epochs), the callback's state not restored
            self._switch(state)
            if self.distill_steps is not None and state.global_step >= self.distill_steps:
                self.switch_step = self.distill_steps
            self.cosine_at_switch, self.exact_calls_at_switch = float("nan"), None
            logger.warning("FANDistillationCallback: resumed after the switch without the callback's saved state, so "
                           "the cosine and exact-gradient calls at the switch are unknown (logged as nan / counted "
                           "from here). TrainingArguments(restore_callback_states_from_checkpoint=True) keeps them.")

    def _check_optimizer(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # (accelerate's wrapper)
        if inner is None or not hasattr(inner, "param_groups"):
            return
        held = {id(p) for g in inner.param_groups for p in g["params"]}
        if any(id(p) not in held for m in self.memories for p in m.fan.parameters()):
            raise ValueError(
                "FANDistillationCallback: the optimizer does not hold the FANs' parameters (they were frozen when it "
                "was built: a model saved after a switch loads them frozen, or a PEFT model leaves them out), so "
                "distillation would change nothing. Pass the callback to the Trainer's constructor (it makes the "
                "FANs trainable before the optimizer is built), or call m.fan.requires_grad_(True) for each memory "
                "in memgrad_hf.callbacks.titans.fan_memories(model) first; with PEFT add "
                "modules_to_save=['titans_memory']."
            )

    def _due(self, state: Any) -> bool:
        return (self.distill_steps is not None and state.global_step >= self.distill_steps) or (
            self.distill_epochs is not None and (state.epoch or 0) >= self.distill_epochs - 1e-6)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.switched and self._due(state):  # (the Trainer sets the fractional state.epoch before this)
            self._switch(state)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.switched and self._due(state):
            self._switch(state)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        m = self._metrics()
        if logs is not None:
            logs.update(m)
        # The Trainer appended its copy of these logs before calling us; keep log_history complete too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(m)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for m in self.memories:
            m.fan.distilling = False  # no FAN training in later evaluation or generation
            m.fan.accumulation_steps = 1
        if getattr(args, "load_best_model_at_end", False) and state.best_model_checkpoint:
            self._mode_of_checkpoint(state.best_model_checkpoint)
        self.summary = {**self._metrics(), "switched": self.switched, "switch_step": self.switch_step,
                        "cosine_at_switch": self.cosine_at_switch, "exact_calls_at_switch": self.exact_calls_at_switch,
                        "cosine_per_memory": [m.fan.cosine for m in self.memories]}

    def _mode_of_checkpoint(self, checkpoint: str) -> None:
        """The Trainer reloaded the best checkpoint's weights only: give the memories the mode they had when it was
        saved (the exact gradient and trainable FANs before the switch), so the final model computes what that
        checkpoint computed when it was evaluated."""
        path = os.path.join(checkpoint, "trainer_state.json")
        if not os.path.isfile(path):
            return
        with open(path) as f:
            step = json.load(f).get("global_step")
        if not isinstance(step, int) or not self.switched or step >= (self.switch_step or 0):
            return
        for m in self.memories:
            m.grad_impl = "manual"
            m.fan.requires_grad_(True)
        if self._model is not None:
            sync_titans_config(self._model)
