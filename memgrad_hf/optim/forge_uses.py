"""FORGE's bookkeeping of uses: which fused weights get their gradient in parts, and when hooked updates apply.

A fused layer updates its weight inside its own backward, which is exact only when that backward brings the whole
gradient. A weight used twice before one backward (a layer called twice, two forwards and one loss, a penalty on the
weight in the loss, looped layers under reentrant checkpointing) is found here -- at forward, in the loss's graph,
or at the gradient hook -- and marked shared: autograd sums its parts and the hook applies them once, as
``torch.optim`` would. Hooked gradients that arrive in parts from backwards nested in the loss's (reentrant
checkpointing runs one per segment) wait for the root's backward to end.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger("memgrad_hf.forge")


_USED_TWICE = ("is used more than once before one backward (a layer called twice, as PEFT's DoRA calls its LoRA "
               "layers; two forwards and one loss; or an earlier forward's graph kept without a backward)")


class UseTracking:
    """The use-tracking part of :class:`memgrad_hf.optim.forge.ForgeOptimizer` (its state is set up there)."""

    def _enter(self, task: int) -> None:
        """The loss's root began backward ``task``: hooked gradients that arrive inside a backward nested in it wait
        for its end (:meth:`_leave`). A root still set from a backward that raised is dropped (its partial gradients
        stay in ``.grad``, as torch leaves them, and join this backward's)."""
        if self._root_task == task:  # (a loss wrapped twice)
            return
        if self._grouped:  # (left by a backward that raised before its end launched them)
            self._launch_grouped()
        self._root_task, self._deferred = task, {}
        self._begin_grouping()
        # A parameter used inside a reentrant checkpointed segment and also outside it (a penalty in the loss) gets
        # one part in this backward and one in the segment's: neither comes first reliably, so all wait
        self._defer_all = self._reentrant_checkpointing()
        torch.autograd.Variable._execution_engine.queue_callback(self._leave)

    def _reentrant_checkpointing(self) -> bool:
        """Whether a layer runs transformers' gradient checkpointing reentrantly."""
        return any(checkpoints_reentrantly(m) for m in self._ckpt_layers)

    def _leave(self) -> None:
        """The root's backward has ended: every deferred gradient is complete; apply (or measure) each once."""
        deferred, self._deferred, self._root_task, self._defer_all = self._deferred, {}, None, False
        self._segment_seen.clear()  # this forward's segments are back-propagated: the next forward counts anew
        for p in deferred:
            self._on_grad(p)
        if self._groups_small:
            self._launch_grouped()

    def _pending(self, weight: Tensor) -> bool:
        """Whether the weight's latest use (its layer's autograd node, or the chunked head's consumer of its gradient)
        is alive and has not run its backward yet."""
        prev = self._last_use.get(weight)
        use = None if prev is None else prev()
        if use is None:
            return False
        state = getattr(use, "state", None)  # (the head's consumer keeps its flag in a dict: no reference cycle)
        return not (state.get("done") if isinstance(state, dict) else getattr(use, "done", False))

    def _note_use(self, weight: Tensor, node: Any) -> None:
        """A fused weight's use was built in forward (``node``: its layer's autograd node, or the chunked head's
        consumer). If its previous use has not run its backward yet (a layer called twice, two forwards before one
        backward), the weight's gradient may have several parts: for this step they are summed by autograd and
        applied once (``_shared``). Recomputations inside a backward (gradient checkpointing) are not uses, except
        under reentrant checkpointing those of a weight its segment's autograd-free forward did not use: a layer that
        runs only with autograd on (a Titans memory's FAN) is first used in the recompute, maybe once per chunk."""
        if torch._C._current_graph_task_id() != -1 and not (self._defer_all and weight not in self._segment_seen):
            return
        self.check_state_fits(weight)
        if weight not in self._shared and (self._pending(weight) or weight in self._segment_seen):
            self._mark_shared(weight, _USED_TWICE, fixed=False)
        self._last_use[weight] = weakref.ref(node)

    def _note_compiled_use(self, weight: Tensor) -> None:
        """:meth:`_note_use` for a compiled layer, whose operator leaves no Python object alive until its backward:
        its uses not yet back-propagated are counted instead (and forgotten at :meth:`step`, where a graph kept
        without a backward stops counting, as its autograd node does for the eager layer)."""
        if torch._C._current_graph_task_id() != -1:  # a recomputation in backward (checkpointing): not a use
            return
        self.check_state_fits(weight)
        n = self._compiled_uses.get(weight, 0)
        if weight not in self._shared and (n or self._pending(weight)):
            self._mark_shared(weight, _USED_TWICE, fixed=False)
        self._compiled_uses[weight] = n + 1

    def _compiled_use_done(self, weight: Tensor) -> None:
        """A compiled layer's use was back-propagated."""
        n = self._compiled_uses.pop(weight, 0)
        if n > 1:
            self._compiled_uses[weight] = n - 1

    def _compiled_weight_grad(self, weight: Tensor, dw: Tensor) -> None:
        """A compiled layer's weight gradient that its backward cannot apply (the weight's gradient has other
        parts): summed into ``.grad`` as autograd sums the eager layer's, and applied once when this backward ends, as
        the hook applies the eager one's (:mod:`memgrad_hf.optim.forge_ops`)."""
        weight.grad = dw if weight.grad is None else weight.grad + dw
        if self._root_task is not None:
            self._deferred[weight] = None
        elif weight not in self._compiled_pending:
            self._compiled_pending.add(weight)

            def apply() -> None:
                self._compiled_pending.discard(weight)
                self._on_grad(weight)

            torch.autograd.Variable._execution_engine.queue_callback(apply)

    def _note_segment_use(self, weight: Tensor) -> None:
        """A fused weight's use in the first, autograd-free forward of a reentrant checkpointed segment. Each segment
        back-propagates in a backward of its own, where its layer would apply its update at once: a weight used in
        two segments (looped or shared layers), twice in one, or in one and outside is summed instead (``_shared``)."""
        if weight not in self._shared and (weight in self._segment_seen or self._pending(weight)):
            self._mark_shared(weight, "is used more than once in one forward under reentrant gradient checkpointing "
                                      "(a layer called twice, looped layers, or a use outside its segment)",
                              fixed=False)
        self._segment_seen.add(weight)

    def scan_uses(self, loss: Tensor) -> None:
        """Once after :meth:`attach` (and again once a fused weight frozen then trains): walk ``loss``'s autograd
        graph and count, for each fused weight, the edges into its gradient accumulator. More than one (a layer called
        twice, a use outside its layer such as a penalty on the weight in the loss) and the weight's parts are summed
        by autograd before its update, from this backward on. Run by ``Accelerator.backward`` (the Trainer) and
        :meth:`backward`; a plain ``loss.backward()`` relies on the checks at forward (``_note_use``) and in the hook
        (``_on_grad``)."""
        if not isinstance(loss, Tensor) or loss.grad_fn is None:
            return
        # a weight frozen during the scan has no edge in the graph: scanned again once one of those trains
        if self._scanned and not any(w.requires_grad for w in self._scan_frozen):
            return
        self._scanned = True
        fused = self._fused - self._shared
        self._scan_frozen = {w for w in fused if not w.requires_grad}
        edges: dict[Tensor, int] = {}
        seen, stack = {loss.grad_fn}, [loss.grad_fn]
        while stack:
            for nxt, _ in stack.pop().next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)  # an AccumulateGrad node: a leaf's gradient accumulator
                if var is not None:
                    if var in fused:
                        edges[var] = edges.get(var, 0) + 1
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        for weight, n in edges.items():
            if n > 1:
                self._mark_shared(weight, f"has {n} uses in the loss's graph (a layer called twice, or a use outside "
                                          "its layer)")

    def _mark_shared(self, weight: Tensor, why: str, fixed: bool = True) -> None:
        """``fixed``: from now on (found in the graph or at the hook); else for this step (found at forward: a graph
        kept alive without a backward looks the same as a second use)."""
        self._shared.add(weight)
        if fixed:
            self._shared_fixed.add(weight)
        if weight in self._warned_shared:
            return
        self._warned_shared.add(weight)
        name = next((n for n, q in self.model.named_parameters() if q is weight), "a weight")
        if why in self._shared_unreported:  # one line per reason and step, not one per weight (prophetnet: 24)
            self._shared_unreported[why].append(name)
            return
        self._shared_unreported[why] = []
        log.warning("forge: %s %s: from now on its gradient within a backward is summed by autograd and then applied "
                    "once, as torch.optim does (its weight gradient exists in full for that moment).", name, why)

    def _report_shared(self) -> None:
        """The weights :meth:`_mark_shared` found this step after the first of each reason, in one line per reason."""
        for why, names in self._shared_unreported.items():
            if names:
                shown = ", ".join(names[:3]) + (f" and {len(names) - 3} others" if len(names) > 3 else "")
                many = len(names) > 1
                log.warning("forge: as above, %d more weight%s %s: %s.", len(names), "s" if many else "",
                            why.replace("is used", "are used", 1) if many else why, shown)
        self._shared_unreported.clear()

    def _note_update(self, p: Tensor) -> None:
        """Warn once when a parameter is updated twice between two step() calls (each backward applies an update)."""
        if p in self._applied and p in self._second_parts:  # (a use outside the layer: its part, applied apart)
            self._second_parts.discard(p)
            return
        if p not in self._applied:
            if not self._applied:  # the step's first update (see ForgeOptimizer._warn_late_hyperparameters)
                self._hp_used = self._hyperparameters()
            self._applied.add(p)
        elif not self._warned_twice:
            self._warned_twice = True
            log.warning(
                "forge: a second backward before optimizer.step() updated the weights again: with FORGE every "
                "backward applies the update. For gradient accumulation in your own loop set optimizer.sync = False "
                "before the backward of every micro-batch but the last (the Trainer does this itself). A loss whose "
                "backward runs more backwards inside it (a cached loss, e.g. sentence-transformers' "
                "CachedMultipleNegativesRankingLoss) must go through optimizer.backward(loss), which applies their "
                "parts once. If this optimizer was replaced by another, call its detach() first: until then it keeps "
                "updating the weights inside backward, and the new optimizer sees no .grad.")


def checkpoints_reentrantly(layer: nn.Module) -> bool:
    """Whether ``layer`` has transformers' gradient checkpointing on with ``use_reentrant`` true or not given (torch's
    checkpoint then takes True)."""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    return bool(layer.gradient_checkpointing) and getattr(func, "keywords", {}).get("use_reentrant") is not False


def segment_starts(opt_ref: Any, layer: nn.Module, args: Any) -> None:
    """Forward pre-hook of a layer with transformers' checkpointing flag: a call that checkpoints reentrantly (its
    forward then runs without autograd) opens a segment, whose fused-weight uses FORGE counts (``_note_segment_use``).
    Calls inside a backward (the recomputation) and under ``no_grad`` (generation) open none."""
    if torch.compiler.is_compiling():  # (a compiled model runs a reentrant checkpoint eagerly: only then break)
        if layer.gradient_checkpointing and checkpoints_reentrantly(layer):
            _segment_starts_eagerly(opt_ref, layer, args)
        return
    opt = opt_ref()
    if (opt is not None and opt._segment is None and layer.training and torch.is_grad_enabled()
            and torch._C._current_graph_task_id() == -1 and checkpoints_reentrantly(layer)):
        opt._segment = layer


def segment_ends(opt_ref: Any, layer: nn.Module, args: Any, out: Any) -> None:
    if torch.compiler.is_compiling():
        if layer.gradient_checkpointing and checkpoints_reentrantly(layer):
            _segment_ends_eagerly(opt_ref, layer, args, out)
        return
    opt = opt_ref()
    if opt is not None and opt._segment is layer:
        opt._segment = None


_segment_starts_eagerly = torch.compiler.disable(segment_starts)
_segment_ends_eagerly = torch.compiler.disable(segment_ends)

