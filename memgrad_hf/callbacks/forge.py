"""``ForgeLogCallback``: the Trainer logs the real gradient norm and skip count of a FORGE optimizer, and the optimizer
is attached to the model only while ``train()`` runs.

With FORGE no ``.grad`` is left when the Trainer measures the norm, so it would log 0; this callback, added to
every Trainer by ``import memgrad_hf`` (a no-op for other optimizers), replaces it with the norm FORGE measured.
When training ends it detaches the optimizer (the model back-propagates normally again: another optimizer, a
saliency map, a Fisher estimate all see ``.grad``); a new ``train()`` of the same Trainer attaches it again.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from memgrad_hf.optim.forge import forge_optimizer_of

log = logging.getLogger("memgrad_hf.forge")


_AFTER_BACKWARD = ("on_pre_optimizer_step", "on_optimizer_step")


def _acts_after_backward(callback: Any) -> bool:
    """A user's callback with code between backward and the optimizer step (the libraries' own only time or stop
    there, e.g. transformers' JIT checkpointing)."""
    for name in _AFTER_BACKWARD:
        owner = next((c for c in type(callback).__mro__ if name in vars(c)), TrainerCallback)  # where it is defined
        if owner is not TrainerCallback and owner.__module__.split(".")[0] not in ("transformers", "trl", "memgrad_hf"):
            return True
    return False


class ForgeLogCallback(TrainerCallback):
    """Puts ``grad_norm`` (pre-clipping global norm) and ``forge_skipped_steps`` into the Trainer's logs; attaches
    the FORGE optimizer to the model for the time of ``train()``."""

    others: list[Any] = []  # the Trainer's other callbacks, set when train() starts (optim.registration)

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, model: Any = None,
                       **kwargs: Any) -> None:
        opt = forge_optimizer_of(optimizer)
        if opt is not None:
            opt.begin_trainer(float(args.max_grad_norm or 0.0), model)
            late = sorted({type(c).__name__ for c in self.others if _acts_after_backward(c)})
            if late:
                log.warning(
                    "%s run on_pre_optimizer_step / on_optimizer_step: with %s the update is applied inside backward, "
                    "so there no weight has a .grad, and gradients edited or hyperparameters (lr) set there do not "
                    "change this step (a hyperparameter applies from the next one). Read gradients with "
                    "tensor.register_hook on the weights, and set the lr in on_step_begin.", ", ".join(late),
                    type(opt).__name__)
            return
        ref = getattr(model, "_memgrad_forge_optimizer", None)
        stale = ref() if ref is not None else None
        if stale is not None and stale._attached and stale.model is model:  # (not a deep copy's original)
            # e.g. a hand-written loop that did not call detach(): it would go on updating in backward at its own lr
            log.warning("A FORGE optimizer was still attached to %s (a training loop without detach()); detaching "
                        "it so that this Trainer's optimizer alone updates the model.", type(model).__name__)
            stale.detach()

    def on_train_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        opt = forge_optimizer_of(optimizer)
        if opt is not None:
            opt.end_trainer()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, optimizer: Any = None,
               **kwargs: Any) -> None:
        opt = forge_optimizer_of(optimizer)
        if opt is None or logs is None or "loss" not in logs:
            return
        extra = {"forge_skipped_steps": opt.skipped_steps}
        if opt.last_grad_norm is not None:
            extra["grad_norm"] = opt.last_grad_norm
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)
