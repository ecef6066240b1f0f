"""FORGE's exact global-norm clipping: the norm of the whole step's gradient, known before any weight changes.

The loss returned by ``model(...)`` (or given to ``Accelerator.backward``) is wrapped in :class:`LossRoot`, whose
backward runs first: under ``max_grad_norm > 0`` and ``clip="exact"`` it starts the norm pass, in one of two ways
(``clip_pass``):

* ``"replay"``: the one backward measures the norms and records, per parameter, what its update needs (a linear
  layer's ``dY`` and input, an embedding's looked-up rows, a small tensor's gradient, a chunked head's block walk);
  once it ends, the records are replayed as updates. No second backward: at most the weight-gradient GEMMs run
  twice (once for the norm, once for the update), and not even those where the tiles fit under the peak memory
  already reached (kept for the replay). Costs the recorded ``dY`` (activation-sized, not weight-sized) until the
  replay.
* ``"backward"``: a norm-only backward through the whole graph (kept with ``retain_graph``), then the update
  backward: a second backward, no extra memory. ``"auto"`` takes it under gradient checkpointing, where recording
  would keep the recomputed activations alive.

``clip="previous"`` instead clips with the previous step's exact norm (no extra pass; documented approximation).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from memgrad_hf.functional import retain_head_grads
from memgrad_hf.kernels import forge as K

if TYPE_CHECKING:
    from memgrad_hf.optim.forge import ForgeOptimizer

log = logging.getLogger("memgrad_hf.forge")


class LossRoot(torch.autograd.Function):
    """Identity on the loss. Its backward runs first: it marks that backward as the one whose hooked updates are
    applied (:meth:`ForgeOptimizer._enter`) and, under exact clipping, runs the norm pass before any update."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, opt: ForgeOptimizer, inner: list) -> Tensor:
        ctx.opt, ctx.inner = opt, inner
        return loss.clone()  # a scalar; a view would forbid the Trainer's in-place loss scaling

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        opt = ctx.opt
        opt._hook_new()  # parameters unfrozen since: their gradient must enter this norm
        for p in opt._hooked - opt._fused:  # (a fused layer's weight was checked at its forward)
            opt.check_state_fits(p)  # a resized weight is refused before any update of this backward
        task = torch._C._current_graph_task_id()
        if opt._measuring(task) or opt._root_task == task:  # (a loss wrapped twice: the outer root did it all)
            return grad, None, None
        if opt.needs_norm_pass and opt._is_sync():
            if opt._replays_clip():
                opt._begin_norm(grad.device, record=task)
                opt._enter(task)  # (its callback is queued first: deferred gradients are measured before the replay)
                # runs when this backward has walked the whole graph: the norm is known, the records replay
                torch.autograd.Variable._execution_engine.queue_callback(opt._end_record)
                return grad, None, None
            opt._norm_pass(ctx.inner[0], grad)
        opt._enter(task)
        return grad, None, None


class NormRoot(torch.autograd.Function):
    """Identity on the loss of a norm-only backward (``clip_pass="backward"``): marks that backward, as
    :class:`LossRoot` marks the update backward."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, opt: ForgeOptimizer) -> Tensor:
        ctx.opt = opt
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        ctx.opt._enter(torch._C._current_graph_task_id())
        return grad, None


class ExactClipping:
    """The clipping part of :class:`memgrad_hf.optim.forge.ForgeOptimizer` (its state is set up there)."""

    @property
    def needs_norm_pass(self) -> bool:
        """Exact clipping is on: every backward must start with the norm-only pass."""
        return self.max_grad_norm > 0 and self.clip == "exact"

    @property
    def _exact_norm(self) -> bool:
        # the norm the updates sum sets the next step's clipping under clip="previous": accumulated in fp64 there;
        # otherwise it is only logged and checks finiteness (exact clipping measured the norm before the updates):
        # a fast fp32 dot is enough
        return self.max_grad_norm > 0 and self.clip == "previous"

    def clip_root(self, loss: Tensor) -> Tensor:
        """``loss`` (a scalar) wrapped so that its backward first runs the norm-only pass (exact clipping), then
        the update pass, and hooked gradients that arrive in parts from nested backwards (reentrant checkpointing)
        are applied once, complete; unchanged when ``loss`` has no graph. What ``Accelerator.backward`` (the
        Trainer) applies to every loss after ``import memgrad_hf``."""
        if not (isinstance(loss, Tensor) and loss.requires_grad and loss.dim() == 0) or isinstance(
                loss.grad_fn, LossRoot._backward_cls):  # (rooted already: the model's own loss)
            return loss
        return LossRoot.apply(loss, self, [loss])

    def _replays_clip(self) -> bool:
        """Exact clipping by recording and replaying the updates (one backward) rather than a second backward."""
        if self.clip_pass != "auto":
            return self.clip_pass == "replay"
        return not self._checkpointing()

    def _measuring(self, task: int) -> bool:
        """A norm pass is under way in backward ``task`` (a loss wrapped twice, e.g. ``model(...).loss * 2`` passed
        to :meth:`backward`, meets a second wrapper inside it: that one does nothing)."""
        return self._mode == "norm" and self._norm_task in (task, "backward")

    def _begin_norm(self, device: torch.device, record: int | None = None) -> None:
        """Enter the norm pass: gradients are measured, not applied; with ``record`` (the id of the backward that
        measures) their updates are recorded too, to be replayed when that backward ends.

        Gradients accumulated over earlier micro-batches step aside: a .grad that appears during the pass is this
        backward's own (autograd's, for hooked tensors and for fused weights used outside their module). Each
        stashed sum is counted once, by whichever path meets it first (_accumulated)."""
        if self._norm_pass_seen and not self._warned_second_norm:  # (said once per optimizer)
            self._warned_second_norm = True
            log.warning(
                "forge: a second backward with exact clipping before step(): each backward is clipped by its own "
                "gradient norm, where torch clips the sum of both by one norm at step(). Sum the losses into one "
                "backward, or set optimizer.sync = False before every backward of the step but the last (their "
                "gradients then wait in .grad and count in the last one's norm).")
        if self._mode == "norm":  # an earlier recording backward never finished (e.g. it raised): nothing applied
            log.warning("forge: a backward with exact clipping did not complete; its updates were not applied")
            self._replays = None
            for p, g in self._stash.items():
                p.grad = g
        self._mode = "norm"
        self._norm_measured = False
        self._norm_sq = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no syncs
        self._room, self._room_wait = {}, {}
        self._stash = {p: p.grad for p in self._group_index if p.grad is not None}
        self._stash_counted = set()
        self._replays = [] if record is not None else None
        self._norm_task = "backward" if record is None else record
        for p in self._stash:
            p.grad = None
        # Trainable parameters outside the groups (unfrozen after the optimizer was built, an adapter switched on
        # since, or left to another optimizer in your own loop): a norm-only backward's gradient is set aside from
        # theirs, which the update backward builds. Under the Trainer they also count in the norm, as in its
        # clip_grad_norm_(model.parameters()); in your own loop the norm is the optimizer's parameters' only.
        self._outside = {p: p.grad for p in self.model.parameters() if p.requires_grad and p not in self._group_index}
        if record is None:
            for p in self._outside:
                p.grad = None

    def _end_norm(self) -> None:
        """Leave the norm pass: restore the stashed gradients and set the clip coefficient (or skip the step)."""
        for p, g in self._stash.items():
            if p not in self._stash_counted:  # accumulated, but this backward did not reach it: applied at step()
                self._measure(g, p)
            p.grad = g
        replayed = self._norm_task != "backward"
        for p, before in self._outside.items():
            g = p.grad if replayed or before is None or p.grad is None else p.grad + before
            if g is not None and self._trainer_managed:
                self._measure(g)
            if not replayed:
                p.grad = before
        self._outside = {}
        self._stash, self._stash_counted, self._norm_task = {}, set(), None
        norm = float(self._norm_sq.sqrt())
        self.last_grad_norm = norm
        # (a backward that met no gradient, torch.autograd.grad of the loss to an input, steps nothing: a real one
        # after it is not "a second backward")
        self._norm_pass_seen = self._norm_pass_seen or self._norm_measured
        if not math.isfinite(norm):
            self._mode = "skip"
            self.skipped_steps += 1
            log.warning("forge: non-finite gradient norm (%s); step skipped (%d so far)", norm, self.skipped_steps)
        else:
            self._mode = "apply"
            self._coef = min(1.0, self.max_grad_norm / (norm + 1e-6))

    def _norm_pass(self, loss: Tensor, grad: Tensor) -> None:
        """Backward through the graph once computing only gradient norms; sets the clip coefficient."""
        self._begin_norm(loss.device)
        try:
            with retain_head_grads():
                with torch.enable_grad():  # (a backward runs without grad mode: the root needs a graph node)
                    root = NormRoot.apply(loss, self)
                try:
                    torch.autograd.backward(root, grad, retain_graph=True)
                except RuntimeError as e:
                    if "donated buffers" not in str(e):
                        raise
                    raise RuntimeError(
                        "memgrad_hf: FORGE's exact clipping runs a norm-only backward before the update backward "
                        "(clip_pass='backward', the default under gradient checkpointing), and this model was "
                        "compiled with torch's donated buffers, which allow one backward only. It was compiled before "
                        "the FORGE optimizer was created (which turns them off): create the optimizer first, or call "
                        "torch._dynamo.reset() and run again, or set torch._functorch.config.donated_buffer = False "
                        "before compiling; or pass clip_pass='replay' (one backward, more memory under "
                        "checkpointing).") from e
        finally:
            self._end_norm()

    def _measure(self, g: Tensor, p: Tensor | None = None) -> None:
        """Add Σ g² (of parameter ``p``, if given: not one the Trainer leaves unclipped) to the norm pass's total (fp64
        across tensors). On CPU each tensor's sum is one fp32 BLAS dot (~4e-7 relative on a 1M-element tile, more
        accurate than the fp32 norm torch's own clipping takes; ~1/16 of an fp64 reduction's time, which converts
        every element: 58 against 919 µs measured); elsewhere an fp64 reduction on the device (the dot's finiteness
        check would wait for the host)."""
        if p is not None and p in self._unclipped:
            return
        self._norm_measured = True
        self._norm_sq += K.norm_sq(g, exact=g.device.type != "cpu")

    def _record(self, fn: Any, *args: Any) -> bool:
        """In a recording norm pass: keep ``fn(*args)`` (the update, replayed once the norm is known)."""
        if self._replays is None:
            return False
        if self._borrowed_inputs:  # (a compiled graph's buffers: overwritten before the replay; parameters are not)
            args = tuple(a.clone() if isinstance(a, Tensor) and not isinstance(a, nn.Parameter) else a for a in args)
        self._replays.append(functools.partial(fn, *args))
        return True

    def _end_record(self) -> None:
        """End of a recording norm pass: set the clip coefficient, then replay the recorded updates in the order
        the backward produced them, each as the update pass would have run it (or, after a non-finite norm, dropping
        them as it would)."""
        replays, self._replays = self._replays or [], None
        self._end_norm()
        # MEMGRAD_FORGE_GROUPED=1: updates from gradients the replay holds anyway (kept linear tiles, hooked
        # parameters' own gradients) are launched together at its end (_update): one grouped Triton launch per kind
        # of tensor instead of one per tensor. Off by default until timed on a GPU with clipping on (run I's
        # "grouped" timing ran without clipping, where no replay happens: benchmarks/RESULTS.md, run I)
        self._grouped = [] if self._mode == "apply" and grouped_replay() else None
        try:
            for fn in replays:
                fn()
            self._launch_grouped()
        finally:
            self._grouped = None

    def _begin_grouping(self) -> None:
        """At the start of the loss's backward, with ``MEMGRAD_FORGE_GROUPED=1``: the updates of small hooked tensors
        (norms' gains, biases) wait for its end and go out in one grouped launch (:meth:`_launch_grouped`), where
        they would be one launch each. Not in a norm pass (its replay groups its own)."""
        if grouped_replay() and self._mode == "apply" and self._grouped is None:
            self._grouped, self._groups_small = [], True

    def _may_keep(self, weight: Tensor) -> bool:
        """Whether a recording norm pass may keep this weight's gradient tiles until the replay: when they fit in
        half the memory the step can still take without raising the process's peak so far (``headroom``).

        A read of the headroom costs ~26 µs of host time on this CPU, per layer, and a GPU's step at batch 1 waits on
        the host; so it is read again only when the room left from the last read (less twice what was kept since)
        is too small, and after a read that found too little, only after 1, 2, 4, ... more layers. Room otherwise
        only grows in a backward (activations are freed): an old read errs on keeping less, and charging twice the
        kept bytes leaves as much again for what else the backward holds meanwhile."""
        need, dev = 2 * weight.numel() * weight.element_size(), weight.device
        room = self._room.get(dev, 0)
        if need > room:
            wait, backoff = self._room_wait.get(dev, (0, 1))
            if wait:
                self._room_wait[dev] = (wait - 1, backoff)
                return False
            room = headroom(dev) or 0
            if need > room:
                self._room[dev], self._room_wait[dev] = room, (backoff, 2 * backoff)
                return False
            self._room_wait.pop(dev, None)
        self._room[dev] = room - need
        return True

    def _apply_tiles(self, weight: Tensor, tiles: list[tuple[int, int, Tensor]]) -> None:
        # the replay of kept tiles: the block path (gradient accumulated over earlier micro-batches added per block)
        blk = self._begin_blocks(weight)
        for r0, r1, tile in tiles:
            self._apply_block(weight, blk, r0, r1, tile, held=True)

    def _replay_grad(self, p: Tensor, g: Tensor) -> None:
        # what autograd does in the update pass: accumulate into .grad (the earlier micro-batches' sum), then the hook
        held = p.grad is None  # (the gradient is then the recorded one, held by the replay until it ends)
        p.grad = g if held else p.grad + g
        self._on_grad(p, held=held)

    def _clip_coef(self, p: Tensor | None = None) -> float:
        """The clip coefficient of this step's updates (of ``p``: 1 where the Trainer leaves it unclipped)."""
        if self.max_grad_norm <= 0 or (p is not None and p in self._unclipped):
            return 1.0
        if self.clip == "exact":
            if not self._norm_pass_seen:
                if self._trainer_managed:  # under a Trainer the norm pass enters through Accelerator.backward
                    raise RuntimeError(
                        "forge: under Trainer, exact clipping (max_grad_norm > 0, clip='exact') measures the norm "
                        "inside Accelerator.backward, and this backward did not go through it (a training_step or "
                        "compute_loss override calling loss.backward()?): call self.accelerator.backward(loss) "
                        "instead, as Trainer.training_step does. Alternatively optim_args='clip=previous' or "
                        "max_grad_norm=0. Nothing was updated by this backward."
                    )
                lost = (" The model's forward no longer runs the wrapper this optimizer put on it to find its loss: "
                        "something replaced model.forward since (e.g. accelerate's remove_hook_from_module put back "
                        "the forward it had saved); optimizer.backward(loss) works regardless, or detach() this "
                        "optimizer and build it again." if self._forward_wrapper_lost() else "")
                raise RuntimeError(
                    "forge: max_grad_norm > 0 with clip='exact' needs the loss to come from model(...) (its .loss or "
                    "a scalar output), or call optimizer.backward(loss). Alternatively pass clip='previous' or "
                    "max_grad_norm=0." + lost
                )
            return self._coef
        prev = self._prev_norm
        return 1.0 if prev is None else min(1.0, self.max_grad_norm / (prev + 1e-6))


def grouped_replay() -> bool:
    """Whether ``MEMGRAD_FORGE_GROUPED=1`` (experimental, off by default) asks for grouped launches: exact clipping's
    replay, and small hooked tensors in a backward (:meth:`ExactClipping._begin_grouping`)."""
    return os.environ.get("MEMGRAD_FORGE_GROUPED", "0").strip() == "1"


def allow_retained_compiled_backward() -> None:
    """Exact clipping by a norm-only backward (``clip_pass="backward"``) back-propagates twice through one graph
    (``retain_graph``), which a graph compiled with torch's donated buffers refuses (they free saved activations
    during the first backward). Turned off for graphs compiled from now on, once per process, and logged: they
    cost memory only inside a compiled backward, and only where training also checkpoints."""
    try:
        from torch._functorch import config as cfg
    except ImportError:  # (no such torch internals: nothing to turn off)
        return
    if getattr(cfg, "donated_buffer", False):
        cfg.donated_buffer = False
        log.info("forge: exact clipping by a second backward (clip_pass='backward'): torch's donated buffers turned "
                 "off for graphs compiled from now on (torch._functorch.config.donated_buffer = False), since a "
                 "compiled graph with them allows one backward only.")


def headroom(device: torch.device) -> int | None:
    """Bytes that can still be allocated without raising the peak so far: the CUDA allocator's peak minus what it
    holds, or on Linux the resident set's high-water mark minus the resident set; None where unknown."""
    if device.type == "cuda":
        # one call into the allocator: max_memory_allocated / memory_allocated each flatten and sort all ~140 of its
        # statistics in Python (~110 µs each here), and this runs per linear layer and step under exact clipping
        stats = torch.cuda.memory_stats_as_nested_dict(device).get("allocated_bytes", {}).get("all")
        if stats:
            return stats["peak"] - stats["current"]
        return torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:  # two fields of one raw read, not a parse of every line: 29 against 55 µs here, per linear layer and step
        fd = os.open("/proc/self/status", os.O_RDONLY)
        try:
            status = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        hwm, rss = (int(status[status.index(k) + len(k):].split(None, 1)[0]) for k in (b"VmHWM:", b"VmRSS:"))
        return 1024 * (hwm - rss)
    except (OSError, ValueError):  # (ValueError: no such field, as bytes.index says)
        return None
