"""FORGE optimizers: the update applied inside the backward pass, so weight gradients never pile up.

* ``nn.Linear`` weights (LoRA A/B included) are updated inside their own backward, one row block of the weight
  gradient at a time (:mod:`memgrad_hf.optim.fused_linear`); the full gradient never exists.
* Every other trainable tensor (embeddings, norms, biases, tied weights, an LM head served by the chunked head)
  is updated by a post-accumulate-grad hook the moment its gradient is complete, and the gradient is freed.

The optimizer is one class, :class:`ForgeOptimizer`, in parts: the updates (here), exact global-norm clipping
(:mod:`memgrad_hf.optim.forge_clip`), the bookkeeping of weights used more than once
(:mod:`memgrad_hf.optim.forge_uses`), checkpoints (:mod:`memgrad_hf.optim.forge_state`) and what it refuses at
construction (:mod:`memgrad_hf.optim.forge_checks`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import types
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from memgrad_hf.kernels import default_backend, forced_backend
from memgrad_hf.kernels import forge as K
from memgrad_hf.kernels.head import vocab_walk_bytes
from memgrad_hf.optim import forge_ops
from memgrad_hf.optim.forge_checks import (
    RESULT_OPTIONS,
    check_flag,
    check_hp,
    check_options,
    check_torch_options,
    note_gradient_readers,
    note_low_precision_weights,
    parse_state_dtype,
    refuse_distributed,
    refuse_offloaded,
    refuse_sparse_gradients,
)
from memgrad_hf.optim.forge_clip import ExactClipping, LossRoot, allow_retained_compiled_backward
from memgrad_hf.optim.forge_state import StateCheckpointing
from memgrad_hf.optim.forge_uses import UseTracking, segment_ends, segment_starts
from memgrad_hf.patches import forge as P
from memgrad_hf.patches.unwrap import present_as_forward

log = logging.getLogger("memgrad_hf.forge")

# clip_pass: how exact clipping gets the norm first ("auto", "replay", "backward"; see forge_clip).
# head_grad: how a chunked LM head (patch_model) produces the weight gradient FORGE consumes in vocabulary blocks:
# "recompute" the logits in backward (no [V x H] buffer; a third more head flops), or "hold" the gradient computed in
# forward until the head's backward (the head's usual flops; one fp32 [V x H] buffer from forward to backward);
# "auto" holds where that buffer is no larger than what recomputing allocates anyway on the torch path (its 32 MiB
# logits block and 4 MiB gradient block: kernels.head.head_backward_vocab_blocks)
_HOLD_MAX_BYTES = 36 << 20
# kernel: a linear weight's update on a GPU: "fused" (dW tiles in the Triton kernel's registers, the update in its
# epilogue) or "split" (dW row tiles by cuBLAS, then the update kernel: the library's GEMM speed, one dW tile in
# memory);
# "auto": split for weights of at least _SPLIT_MIN_NUMEL elements. On an H100 (run F), one 11008 x 4096 layer took
# 480 µs of device time split against 722 fused, and a 7B model's step with forge_lion 1.29x adamw_torch_fused's
# split, 1.37x fused; at 2048 x 2048 (a ~1B model, host-bound at batch 1) the fused kernel's one launch is cheaper.
_SPLIT_MIN_NUMEL = 4096 * 4096
_MIN_8BIT_NUMEL = 4096  # smaller tensors keep fp32 state under state_dtype="8bit"
# MEMGRAD_FORGE_GROUPED=1: hooked tensors up to this size (norms' gains, biases) are updated together when the
# backward ends, one grouped launch instead of one each (~33 launches per step at ~1B); their gradients stay that long
_GROUPED_NUMEL = 1 << 16
_NO_CONTEXT = contextlib.nullcontext()
_FORWARD_KEYS = itertools.count()  # one __dict__ key per model forward wrapper (_wrap_model_forward)


class _LinearPlan(NamedTuple):
    """A fused linear weight's update, resolved once (ForgeOptimizer._linear_plan)."""

    forced: str  # MEMGRAD_BACKEND when resolved
    contiguous: bool  # the Triton kernels take contiguous weights only
    state: dict[str, Any]  # the weight's optimizer state ("step" included)
    rule_state: dict[str, Tensor]  # the same without "step": what the update kernel takes
    rows: int  # rows per weight-gradient tile
    impl: Any  # the update: Triton kernel (fused or split) or the torch twin
    position: int  # the parameter's position: its rounding-noise seeds
    rule: str  # the update rule it was resolved for (ForgeSGD's changes when a scheduler sets momentum)
    shape: torch.Size  # the weight's shape then (a resize swaps the weight's data in place)


def _rule_state(st: dict[str, Any]) -> dict[str, Tensor]:
    """A parameter's optimizer state without its step count: what the update kernels take."""
    return {k: v for k, v in st.items() if k != "step"}


def _noise_seed(position: int, step: int) -> int:
    """The rounding-noise seed of a parameter's update: a function of (parameter position, step) only, so that a
    resumed run rounds as the uninterrupted one did."""
    return (position * 1_000_003 + step * 1_009) & 0x7FFFFFFF


def _warn_held_grads(name: str, params: Iterable[Tensor]) -> None:
    """FORGE's loop has no ``zero_grad``: a ``.grad`` found at an update is taken as accumulated over earlier
    micro-batches and added in. One left from before the optimizer existed (a backward without it, a PEFT adapter
    trained while outside it) would silently join the first update."""
    held = sum(1 for p in params if p.requires_grad and p.grad is not None)
    if held:
        log.warning("memgrad_hf: %d parameters already hold a .grad as this %s is created. FORGE adds a .grad it finds "
                    "into the next update (as gradient accumulated over earlier micro-batches), so these would join "
                    "the first step. If they are stale (a backward before the optimizer existed, a PEFT adapter "
                    "trained outside it), call optimizer.zero_grad() before training.", held, name)


def _next_step(st: dict[str, Any]) -> int:
    """Advance a parameter's step count (a CPU tensor, as torch.optim keeps it) and return it: ``fill_`` with the
    next integer costs a quarter of ``+= 1`` (~1 against ~4 µs here; this runs per layer and step)."""
    step = int(st["step"].item()) + 1
    st["step"].fill_(step)
    return step


_GRADIENT_STATE: list[type | None] = []  # (a list, not functools.cache: torch.compile traces this and warns on caches)


def _gradient_state_class() -> type | None:
    """accelerate's ``GradientState`` (whether this micro-batch syncs), imported once: read per layer and step."""
    if not _GRADIENT_STATE:
        try:
            from accelerate.state import GradientState
        except Exception:
            GradientState = None  # noqa: N806
        _GRADIENT_STATE.append(GradientState)
    return _GRADIENT_STATE[0]


class ForgeOptimizer(ExactClipping, UseTracking, StateCheckpointing, Optimizer):
    """Base class; use :class:`ForgeAdamW`, :class:`ForgeLion` or :class:`ForgeSGD`."""

    rule: str = ""
    _attached_now: weakref.WeakSet = weakref.WeakSet()  # FORGE optimizers attached to a model, process-wide

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        model: nn.Module | None = None,
        max_grad_norm: float = 0.0,
        clip: str = "exact",
        tile_bytes: int | None = None,
        stochastic_rounding: bool = False,
        state_dtype: torch.dtype | str | None = None,
        forge_model: nn.Module | None = None,
        _trainer_managed: bool = False,
        head_grad: str = "auto",
        kernel: str = "auto",
        clip_pass: str = "auto",
        **torch_options: Any,
    ) -> None:
        # forge_model: the model under a keyword that the Trainer's optimizer_cls_and_kwargs and PEFT's
        # create_loraplus_optimizer leave free. _trainer_managed (set by the optim="forge_*" registration; for any
        # other optimizer by Trainer.train, see begin_trainer): its losses reach backward through accelerate's
        # Accelerator.backward, where the loss's root hooks in (any loss: the model's, GRPO's, a compute_loss_func's)
        self._trainer_managed = _trainer_managed
        model = model if model is not None else forge_model
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                f"{type(self).__name__}: model must be the nn.Module being trained; got {type(model).__name__} "
                f"{model!r}. The second positional argument is the model: pass the learning rate by keyword, e.g. "
                f"{type(self).__name__}(model.parameters(), model=model, lr=1e-3)."
            )
        if isinstance(params, nn.Module):  # ForgeAdamW(model, lr=...); also Trainer(optimizer_cls_and_kwargs=(cls,
            model = params if model is None else model  # {"model": m})), which passes the model as the params
            params = params.parameters()
        check_options(clip=clip, clip_pass=clip_pass, head_grad=head_grad, kernel=kernel, tile_bytes=tile_bytes,
                      max_grad_norm=max_grad_norm)
        if model is None:
            raise ValueError(
                f"{type(self).__name__} needs the model (model=...) to fuse the update into its linear layers' "
                "backward, e.g. ForgeAdamW(model.parameters(), model=model, lr=1e-4); in "
                "Trainer(optimizer_cls_and_kwargs=...) pass it as forge_model=model (the Trainer takes 'model' for "
                "the parameters)."
            )
        refuse_distributed(model)
        check_torch_options(type(self).__name__, torch_options, ("model", *defaults))
        state_dtype = parse_state_dtype(state_dtype)
        super().__init__(params, defaults)
        note_low_precision_weights(self.param_groups, state_dtype)
        refuse_sparse_gradients(type(self).__name__, model, {p for g in self.param_groups for p in g["params"]})
        refuse_offloaded(type(self).__name__, [p for g in self.param_groups for p in g["params"]])
        note_gradient_readers(model)
        self.model = model
        self.max_grad_norm = float(max_grad_norm)
        self.clip = clip
        self.clip_pass = clip_pass
        self.head_grad = head_grad
        self.kernel = kernel
        self.tile_bytes = None if tile_bytes is None else int(tile_bytes)
        self.stochastic_rounding = check_flag(type(self).__name__, "stochastic_rounding", stochastic_rounding)
        self.state_dtype = state_dtype
        self.sync: bool | None = None  # None: follow accelerate's GradientState (Trainer); else set by the user
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._mode = "apply"  # "norm" during the norm pass, "skip" after a non-finite norm
        self._norm_sq: Tensor | None = None
        self._coef = 1.0
        self._prev_norm: float | None = None
        self._stash: dict[Tensor, Tensor] = {}  # accumulated gradients, set aside during the norm pass
        self._outside: dict[Tensor, Tensor | None] = {}  # trainable parameters outside the groups (_begin_norm)
        self._stash_counted: set[Tensor] = set()
        self._replays: list[Any] | None = None  # clip_pass="replay": the updates recorded during the norm pass
        self._grouped: list[tuple] | None = None  # updates set aside for one grouped launch (_update)
        self._groups_small = False  # (set aside: those of small hooked tensors too, in a backward whose end launches)
        # inside a compiled graph's operator: its tensor arguments are the graph's buffers, which inductor reuses
        # (or donates) once the operator returns, so a recorded update must keep copies (memgrad_hf.optim.forge_ops)
        self._borrowed_inputs = False
        self._room: dict[torch.device, int] = {}  # memory headroom read in this norm pass, less what was kept
        self._room_wait: dict[torch.device, tuple[int, int]] = {}  # (layers until the next read, the wait after)
        self._norm_task: int | str | None = None  # the backward measuring the norm ("backward": a norm-only pass)
        self._nonfinite_seen = False
        # The backward the loss's root began (_enter), and the hooked parameters whose gradient arrived inside a
        # backward nested in it (reentrant gradient checkpointing runs one per segment: a parameter used in two
        # segments, or in one and in the loss, gets its gradient in parts there): applied once, complete, when the
        # root's backward ends (_leave)
        self._root_task: int | None = None
        self._deferred: dict[Tensor, None] = {}
        self._defer_all = False  # this backward's every hooked gradient waits for its end (reentrant checkpointing)
        # per device: (Σ g² of this step's updates, skipped tiles), summed in place on the device by every update
        # and read once, in step(); kept across steps (zeroed there) so that a layer's update allocates nothing
        self._step_sums: dict[Any, tuple[Tensor, Tensor]] = {}  # (per device; see _sums)
        self._group_index = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_index_pos = {p: k for k, p in enumerate(self._group_index)}
        self._plans: dict[Tensor, _LinearPlan] = {}
        # A weight whose gradient has several parts in one backward (a layer called twice, two forwards before one
        # backward, a use outside its layer): its parts are summed by autograd and applied once, by the hook
        self._shared: set[Tensor] = set()
        self._shared_fixed: set[Tensor] = set()  # found in the graph or at the hook: shared from then on
        self._warned_shared: set[Tensor] = set()
        self._shared_unreported: dict[str, list[str]] = {}  # reason -> names found after its first, this step
        # fused weight -> weakref to its latest use not yet back-propagated: the autograd node of its layer, or the
        # chunked head's consumer of its gradient (see _pending)
        self._last_use: dict[Tensor, Any] = {}
        # under reentrant checkpointing a segment's first forward runs without autograd (no node to note): the fused
        # weights it used in this forward, and the segment (checkpointed layer call) running now, if any
        self._segment_seen: set[Tensor] = set()
        self._segment: nn.Module | None = None
        self._segment_hooks: list[Any] = []
        self._in_layer: set[Tensor] = set()  # fused weights whose layer back-propagated since the last step()
        self._applied: set[Tensor] = set()  # updated since the last step(): a second update there is warned about
        self._warned_nested = False
        self._unclipped: set[Tensor] = set()  # trained, but outside the Trainer's model: not clipped (begin_trainer)
        self._second_parts: set[Tensor] = set()  # a use outside the layer found this step: one more update expected
        self._warned_twice = False
        self._warned_nosync = False
        self._warned_second_norm = False  # (forge_clip._begin_norm)
        self._clip_call_warned = False  # a clip_grad_norm_ call that clips nothing was warned about (registration)
        self._swapped: list[nn.Module] = []
        self._hooks: list[Any] = []
        self._wrapped_forward = False
        self._norm_pass_seen = False
        self._norm_measured = False  # (this norm pass met a gradient: a pass that met none is not a step's)
        self._attached = False
        self._solo_checked = False
        self._hp_used: list[dict[str, Any]] | None = None  # the groups as this step's first update read them
        self._warned_late_hp = False
        self._unhooked: list[Tensor] = []
        forge_ops.register(self)  # how a compiled model's FORGE layers find this optimizer
        self._compiled_pending: set[Tensor] = set()
        self._compiled_uses: dict[Tensor, int] = {}  # weight -> its compiled layer's uses not back-propagated yet
        if not _trainer_managed:  # one the Trainer builds attaches when train() starts: create_optimizer() may come
            self.attach()         # before it (to inspect the groups), and a backward until then must stay plain

    def attach(self) -> None:
        """Fuse the update into the model's layers (done by the constructor; one the Trainer builds for
        ``optim="forge_*"``, when ``train()`` starts): swap the forward of its plain
        ``nn.Linear`` / ``nn.Embedding`` layers and hook every other trainable parameter. Undone by :meth:`detach`;
        the Trainer detaches when ``train()`` ends and attaches again when it starts, so that the model trains (and
        back-propagates) normally in between, e.g. under another optimizer."""
        if self._attached:
            return
        model = self.model
        ref = getattr(model, "_memgrad_forge_optimizer", None)
        previous = ref() if ref is not None else None
        if previous is not None and previous is not self and previous.model is model and previous._attached:
            # (a deep copy of the model carries the original's reference: that optimizer is left alone)
            if not set(previous._group_index) & set(self._group_index):
                raise ValueError(
                    f"{type(self).__name__}: {type(previous).__name__} already updates other parameters of this "
                    f"{type(model).__name__} inside backward; two FORGE optimizers cannot share one model. Pass each "
                    "the submodule it trains (e.g. ForgeAdamW(G.parameters(), model=G) and ForgeAdamW(D.parameters(), "
                    "model=D) for a GAN)."
                )
            previous.detach()  # one FORGE optimizer per model at a time (e.g. a second Trainer takes over)
        model._memgrad_forge_optimizer = P.OptimizerRef(self)
        # the layers with transformers' gradient_checkpointing flag, found once: its is_activation_checkpointing
        # property walks every module (~9 ms on a 32-layer PEFT model), too slow to read per backward
        self._ckpt_layers: list[nn.Module] = [m for m in model.modules()
                             if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
        me = P.OptimizerRef(self)  # (a deep copy of the model copies its hooks: they must not copy the optimizer)
        self._segment_hooks = [h for m in self._ckpt_layers for h in (
            m.register_forward_pre_hook(functools.partial(segment_starts, me)),
            m.register_forward_hook(functools.partial(segment_ends, me), always_call=True))]
        counts: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
        fusable = {id(p) for p in self._group_index if counts.get(id(p), 0) == 1 and p.requires_grad}
        self._swapped = P.swap_layers(model, self, fusable)
        self._fused = {m.weight for m in self._swapped}  # nn.Linear and nn.Embedding weights
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._group_index
                       if p.requires_grad]
        self._hooked = {p for p in self._group_index if p.requires_grad}
        with torch.enable_grad():  # each one's gradient accumulator, for a compiled layer (forge_ops._accumulates)
            self._grad_nodes = {w: torch.autograd.graph.get_gradient_edge(w).node for w in self._fused}
        self._unhooked = [p for p in self._group_index if not p.requires_grad]  # (see _hook_new)
        _warn_held_grads(type(self).__name__, self._group_index)
        self._attached = True
        self._solo_checked = False  # (see _refuse_distributed)
        ForgeOptimizer._attached_now.add(self)
        if self.needs_norm_pass and not self._replays_clip():
            allow_retained_compiled_backward()
        self._scanned = False  # (scan_uses runs once per attach)
        self._scan_frozen: set[Tensor] = set()
        # A chunked LM head hands its weight gradient over in vocabulary blocks instead of building it.
        from memgrad_hf.patches.head import set_head_weight_consumer

        set_head_weight_consumer(model, self._head_weight_consumer)
        if not self._trainer_managed:
            self._wrap_model_forward()

    # ------------------------------------------------------------------------------------------- plumbing

    def _is_sync(self) -> bool:
        if self.sync is not None:
            return self.sync
        cls = _gradient_state_class()
        if cls is None:
            return True
        # a Borg: every instance reads the class's one shared dict (cleared in place on reset; empty until first
        # instantiated, when sync_gradients starts True). Read directly: this runs per layer and step
        shared = getattr(cls, "_shared_state", None)
        return bool(shared.get("sync_gradients", True)) if isinstance(shared, dict) else bool(cls().sync_gradients)


    def _hp(self, p: Tensor) -> dict[str, Any]:
        # Read the group at call time: accelerate replaces param_group dicts, the scheduler edits "lr" in place.
        return self.param_groups[self._group_index[p]]

    def _state(self, p: Tensor) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
        names = K.RULES[self.rule][1]
        self.check_state_fits(p)
        if len(st) <= len(names):  # new, or a rule that keeps more state since (SGD given momentum by a scheduler)
            dtype = self._state_dtype_for(p)
            for name in names:
                if name not in st:
                    st[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    if dtype == K.Q_DTYPE:
                        st[name + ".scale"] = torch.ones(K.scale_shape(p.shape), dtype=torch.float32, device=p.device)
        return st

    def check_state_fits(self, p: Tensor) -> None:
        """Refuse a parameter whose shape changed since its state was made (``resize_token_embeddings`` swaps the
        weight's data in place): the update would index the old state as the new shape. Checked at each fused
        layer's forward and, for the other parameters, when the loss's backward starts: before any update of the
        step, so nothing is half-applied."""
        plan = self._plans.get(p)  # (the common case, per layer and step: a linear weight as its plan found it)
        if plan is not None and plan.shape == p.shape:
            return
        st = self.state.get(p)
        if not st:
            return
        for name in K.RULES[self.rule][1]:
            v = st.get(name)
            if v is not None and v.shape != p.shape:
                where = next((n for n, q in self.model.named_parameters() if q is p), "a parameter")
                raise ValueError(
                    f"{type(self).__name__}: {where} is {tuple(p.shape)} now, but its optimizer state was made for "
                    f"{tuple(v.shape)} (model.resize_token_embeddings after the optimizer was built?). Build the "
                    "optimizer again after resizing (under Trainer: a new Trainer), or resize before building it.")

    def _state_dtype_for(self, p: Tensor) -> torch.dtype:
        if self.state_dtype is None:  # auto: like torch.optim, state in the weight's precision (bf16 for bf16/fp16)
            return torch.bfloat16 if p.dtype in (torch.bfloat16, torch.float16) else K.compute_dtype(p)
        # 8-bit only pays off for matrices; small tensors (norms, biases) keep fp32 state
        if self.state_dtype == K.Q_DTYPE and not (p.dim() == 2 and p.numel() >= _MIN_8BIT_NUMEL):
            return torch.float32
        return self.state_dtype


    def begin_trainer(self, max_grad_norm: float, model: nn.Module | None = None) -> None:
        """Called when a ``Trainer`` starts training with this optimizer. One the Trainer built (``--optim
        forge_*``) clips at the Trainer's ``max_grad_norm`` as it is now, as the Trainer clips its own optimizers
        (a value changed between two ``train()`` calls applies). One given to it ready-made keeps its own norm, and
        the Trainer's applies on top (clipping at one norm and then at another is clipping at the smaller) until
        ``end_trainer`` gives its own back; its norm pass then hooks into ``Accelerator.backward`` as for one the
        Trainer built."""
        refuse_distributed(self.model)  # (the process group may have started after the constructor's check)
        if not self._trainer_managed:
            self.detach()  # (undoes the forward wrapper of a hand-written loop's exact clipping)
            self._trainer_managed = True
            self._managed_by_trainer_call = True
            self._own_max_grad_norm = self.max_grad_norm
        if getattr(self, "_managed_by_trainer_call", False):
            own = self._own_max_grad_norm
            if max_grad_norm > 0 and (own == 0 or max_grad_norm < own):
                if own:
                    log.warning("%s: clipping at the Trainer's max_grad_norm=%s, below the optimizer's own %s.",
                                type(self).__name__, max_grad_norm, own)
                self.max_grad_norm = float(max_grad_norm)
            else:
                self.max_grad_norm = own
        else:
            self.max_grad_norm = float(max_grad_norm)
        # a use still pending from before this train() is not one this training back-propagates (the graph of an
        # attempt that auto_find_batch_size retries, alive until collected): a second use it is not
        self._last_use.clear()
        self._compiled_uses.clear()
        # the Trainer clips clip_grad_norm_(model.parameters()): parameters this optimizer trains outside its model
        # (sentence-transformers' SoftmaxLoss keeps a classifier in the loss module) are neither in the norm nor
        # clipped there, so not here either
        scope = None if model is None else set(model.parameters())
        self._unclipped = set() if scope is None else {p for g in self.param_groups for p in g["params"]
                                                       if p not in scope}
        self.attach()

    def end_trainer(self) -> None:
        """``Trainer.train()`` ended (or stopped): detach, and hand a ready-made optimizer back to hand-written use
        with its own ``max_grad_norm``."""
        self.detach()
        self._unclipped = set()
        if getattr(self, "_managed_by_trainer_call", False):
            self._trainer_managed = self._managed_by_trainer_call = False
            self.max_grad_norm = self._own_max_grad_norm

    def _wrap_model_forward(self) -> None:
        model, opt = self.model, self
        self._had_instance_forward = "forward" in model.__dict__
        # The forward it wraps is kept in the model's __dict__, bound to the model, under a key of its own (a wrapper
        # left in place by detach may sit inside the next one): copy.deepcopy rebinds it to the copy, which then runs
        # its own forward, plain (opt.model is not the copy), where a closure would run the original model's
        key = f"_memgrad_forge_inner_forward_{next(_FORWARD_KEYS)}"
        model.__dict__[key] = model.forward
        on = {"wrap": True}  # off once detached while something wraps it in turn (see detach)

        def forward(self_: nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = self_.__dict__[key](*args, **kwargs)
            return opt._wrap_loss(out) if on["wrap"] and opt.model is self_ else out

        present_as_forward(forward, model)
        forward._memgrad_forge_on = on  # type: ignore[attr-defined]
        model.forward = types.MethodType(forward, model)
        self._wrapped_forward = True
        self._forward_key = key
        self._forward_switch = on

    def _forward_wrapper_lost(self) -> bool:
        """Whether this optimizer wrapped the model's forward (:meth:`_wrap_model_forward`) and ``model.forward`` no
        longer reaches that wrapper (following ``__wrapped__`` through wrappers put around it since)."""
        if not getattr(self, "_wrapped_forward", False) or self.model is None:
            return False
        from memgrad_hf.patches.head import head_patch

        fwd = self.model.__dict__.get("forward")
        for _ in range(32):
            if fwd is None:
                return True
            func = getattr(fwd, "__func__", fwd)
            if getattr(func, "_memgrad_forge_on", None) is self._forward_switch:
                return False
            patch = head_patch(self.model) if getattr(func, "_memgrad_head", False) else None
            fwd = patch.original if patch is not None else getattr(fwd, "__wrapped__", None)  # (the head's inner one)
        return False

    def _wrap_loss(self, out: Any) -> Any:
        if torch.compiler.is_compiling():  # (one break, after the model's last op: dynamo cannot trace the root)
            return self._wrap_loss_eagerly(out)
        if not torch.is_grad_enabled():
            return out
        if isinstance(out, Tensor):
            return LossRoot.apply(out, self, [out]) if out.requires_grad and out.dim() == 0 else out
        loss = out.get("loss") if hasattr(out, "get") else None
        if isinstance(loss, Tensor) and loss.requires_grad:
            out["loss"] = LossRoot.apply(loss, self, [loss])
        return out

    @torch.compiler.disable
    def _wrap_loss_eagerly(self, out: Any) -> Any:
        return self._wrap_loss(out)

    def detach(self) -> None:
        """Undo the model changes (linear swaps, hooks, forward wrapper): the model back-propagates normally again
        (gradients in ``.grad``) and this optimizer no longer updates it; its state is kept, and :meth:`attach`
        resumes. Call it when your own training loop ends."""
        from memgrad_hf.patches.head import set_head_weight_consumer

        set_head_weight_consumer(self.model, None)
        P.restore_layers(self._swapped)
        for h in (*self._hooks, *self._segment_hooks):
            h.remove()
        self._segment_hooks, self._segment = [], None
        if self._wrapped_forward:
            self._forward_switch["wrap"] = False
            current = self.model.__dict__.get("forward")
            if getattr(getattr(current, "__func__", None), "_memgrad_forge_on", None) is self._forward_switch:
                self.model.__dict__.pop("forward")
                inner = self.model.__dict__.pop(self._forward_key)
                if self._had_instance_forward:
                    self.model.forward = inner
            # else wrapped in turn since (accelerate's autocast wrapper, ...): kept, ours passes calls through
            self._wrapped_forward = False
        self._swapped, self._hooks, self._fused, self._hooked, self._unhooked = [], [], set(), set(), []
        self._grad_nodes = {}
        self._root_task, self._deferred = None, {}
        self._attached = False
        ForgeOptimizer._attached_now.discard(self)
        if getattr(self.model, "_memgrad_forge_optimizer", lambda: None)() is self:
            del self.model._memgrad_forge_optimizer

    # ------------------------------------------------------------------------------------------- the step

    def _checkpointing(self) -> bool:
        """Whether gradient checkpointing is on (transformers' flag on any of the model's layers)."""
        if self._ckpt_layers:
            return any(m.gradient_checkpointing for m in self._ckpt_layers)
        on = getattr(self.model, "is_activation_checkpointing", None)  # (a model without such layers; older name:)
        return bool(on if on is not None else getattr(self.model, "is_gradient_checkpointing", False))


    def _apply(self, p: Tensor, g: Tensor, held: bool = False) -> None:
        """Update a hooked (non-fused) parameter from its complete gradient, then the gradient is dropped."""
        hp, st = self._hp(p), self._state(p)
        coef = self._clip_coef(p)
        self._note_update(p)
        step = _next_step(st)
        self._update(p, p.data, g, _rule_state(st), hp, step, coef, _noise_seed(self._group_index_pos[p], step), 0,
                     held)

    def _update(self, p: Tensor, target: Tensor, g: Tensor, st: dict[str, Tensor], hp: dict[str, Any], step: int,
                coef: float, seed: int, offset: int, held: bool = False) -> None:
        """Apply the rule to ``target`` (``p`` or a row block of it at element ``offset``) from the gradient ``g``;
        its norm is logged, a non-finite ``g`` is skipped and counted (on a GPU, per tile, without a host sync).
        ``held``: ``g`` stays alive until the exact-clipping replay ends anyway, so on the Triton path the update
        may wait for that replay's grouped launch (:meth:`_launch_grouped`) at no memory cost."""
        if not self._solo_checked:
            self._refuse_distributed()
        impl = self._update_impl(target, g)
        if (self._grouped is not None and impl is not K.update_step and p not in self._unclipped
                and (held or (self._groups_small and target.numel() <= _GROUPED_NUMEL))):
            self._grouped.append((target, g, st, hp, step, seed, offset, coef))
            return
        with torch.no_grad():
            impl(self.rule, target, g, st, hp, step, coef=coef, seed=seed, offset=offset,
                 stochastic_rounding=self.stochastic_rounding, exact_norm=self._exact_norm,
                 chunk_elems=max(self._tile_bytes(p) // 4, 1), sums=self._sums(target.device, p))

    def _launch_grouped(self) -> None:
        """The updates :meth:`_update` set aside during an exact-clipping replay, or a backward's small hooked
        tensors: one grouped Triton launch per kind of tensor (per device and clip coefficient, which one step
        shares)."""
        from memgrad_hf.kernels import forge_triton

        self._groups_small = False

        batches: dict[tuple[torch.device, float], list] = {}
        for *item, coef in self._grouped or ():
            batches.setdefault((item[0].device, coef), []).append(tuple(item))
        self._grouped = None
        with torch.no_grad():
            for (device, coef), items in batches.items():
                forge_triton.update_many(self.rule, items, coef=coef, stochastic_rounding=self.stochastic_rounding,
                                         sums=self._sums(device))

    def _refuse_distributed(self) -> None:
        """The constructor's check again, at the first update after each attach: an optimizer built before the
        process group (then the Trainer's, or ``Accelerator.prepare``'s DDP wrapper) would otherwise update each rank
        from its own gradient, and the replicas drift apart."""
        refuse_distributed(self.model)
        self._solo_checked = True

    def _sums(self, device: torch.device, p: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """This step's (Σ g², skipped tiles) accumulators on ``device`` (fp32 where the Triton kernels add into them
        atomically; fp64 for the torch path). Σ g² is logged as the gradient norm (and clips the next step with
        clip='previous'); with exact clipping the norm pass measures the norm instead. A parameter the Trainer
        leaves out of its norm (``_unclipped``) adds into a pair of its own, whose Σ g² is not read."""
        key = device if p is None or p not in self._unclipped else ("unclipped", device)
        sums = self._step_sums.get(key)
        if sums is None:
            fp = torch.float32 if default_backend("forge", device) == "triton" else torch.float64
            sums = (torch.zeros((), dtype=fp, device=device), torch.zeros((), dtype=torch.int32, device=device))
            self._step_sums[key] = sums
        return sums

    def _update_impl(self, target: Tensor, g: Tensor):
        """One Triton kernel per update on CUDA (no host sync, no temporaries), else the torch twin (which also
        takes non-contiguous tensors)."""
        if (default_backend("forge", target.device) == "triton" and target.is_contiguous() and g.is_contiguous()
                and self.rule in K.KERNEL_RULES and target.dtype != torch.float64):
            from memgrad_hf.kernels import forge_triton

            return forge_triton.update_step
        return K.update_step

    def _tile_bytes(self, p: Tensor, linear: bool = False) -> int:
        """Bytes of one weight-gradient tile: ``tile_bytes`` if given; else 4 MiB on CPU (cache-sized work) and
        64 MiB on a GPU, where each tile costs a handful of kernel launches and one host sync (a 1B model's step
        would otherwise launch ~10^5 kernels). A linear layer's cuBLAS tiles (``kernel=split``) on a GPU: 256 MiB,
        a 7B model's layers in one tile each (on an H100, one 11008 x 4096 layer's device time fell with tile size,
        705 µs at 4 MiB to 480 at 64 MiB, while each tile cost ~200 µs of host time)."""
        if self.tile_bytes is not None:
            return self.tile_bytes
        if p.device.type != "cuda":
            return 4 << 20
        return (256 << 20) if linear and self._linear_kernel(p) == "split" else (64 << 20)

    def _linear_kernel(self, weight: Tensor) -> str:
        """``"fused"`` or ``"split"``: the GPU kernel that updates this linear weight (``kernel``; ``"auto"``: split
        for weights of at least 4096 x 4096 elements, where cuBLAS's GEMM pays for the second launch)."""
        if self.kernel != "auto":
            return self.kernel
        return "split" if weight.numel() >= _SPLIT_MIN_NUMEL else "fused"

    def _linear_weight_backward(self, weight: Tensor, dy: Tensor, x: Tensor) -> None:
        """Called from the fused linear's backward with ``dy`` ``[N, out]`` and ``x`` ``[N, in]``."""
        if not self._solo_checked:
            self._refuse_distributed()
        nested = self._nested_part(weight)
        if not nested:
            self._in_layer.add(weight)
        if nested or not self._is_sync():  # gradient accumulation: keep the sum in .grad until the sync micro-batch
            g = (dy.t() @ x).to(weight.dtype)
            weight.grad = g if weight.grad is None else weight.grad + g
            return
        if self._mode == "norm":
            acc, rows = self._accumulated(weight), self._linear_rows(weight)
            # the norm without forming dW where that takes fewer flops, whether or not the tiles are kept: keeping
            # follows the memory headroom, which a resumed run sees differently, and must not change the norm. Not
            # under autocast (bf16 operands, fp32 weight): autograd's dW is rounded to bf16 before it meets the fp32
            # weight, and the Grams' norm of the unrounded product moved the clip coefficient by ~1e-4
            gram = (acc is None and dy.dtype == weight.dtype
                    and K.gram_pays(dy.shape[0], dy.shape[1], x.shape[1]))
            if gram and weight not in self._unclipped:
                self._norm_sq += K.linear_grad_norm_sq(dy, x)
                self._norm_measured = True
            if self._replays is not None and self._may_keep(weight):
                # the tiles stay for the replay (no second dW GEMM): memory the step has already used
                kept = []
                for r0, r1, tile in K.linear_weight_tiles(dy, x, rows, None, weight.dtype):
                    if not gram:
                        self._measure(tile if acc is None else tile + acc[r0:r1], weight)
                    kept.append((r0, r1, tile))
                self._record(self._apply_tiles, weight, kept)
                return
            if not gram:
                for _, _, tile in K.linear_weight_tiles(dy, x, rows, acc, weight.dtype):
                    self._measure(tile, weight)
            self._record(self._linear_weight_backward, weight, dy, x)
            return
        acc, weight.grad = weight.grad, None
        if self._mode == "skip":
            return
        coef = self._clip_coef(weight)  # (first: when it raises, no step count has moved)
        plan = self._linear_plan(weight)
        self._note_update(weight)
        step = _next_step(plan.state)
        sums = self._sums(weight.device, weight)
        seed = _noise_seed(plan.position, step)
        # backward runs without grad mode (unless create_graph): entering no_grad per layer costs ~2 µs of host time
        with torch.no_grad() if torch.is_grad_enabled() else _NO_CONTEXT:
            plan.impl(
                self.rule, dy, x, weight.data, plan.rule_state, self._hp(weight), step, acc,
                rows_per_tile=plan.rows, stochastic_rounding=self.stochastic_rounding, seed=seed,
                sums=sums, exact_norm=self._exact_norm, coef=coef,  # (the Triton kernels ignore exact_norm)
            )

    def _nested_part(self, weight: Tensor) -> bool:
        """Whether this backward is nested in the loss's (a cached loss such as sentence-transformers' GradCache
        back-propagates each mini-batch in one, from inside the loss's backward): it brings part of the gradient,
        which joins ``.grad`` and is applied once, complete, when the loss's backward ends (:meth:`_leave`). Not under
        reentrant checkpointing, whose nested backwards bring each segment's layers their whole gradient. Known only
        where the loss's root began the backward (``opt.backward(loss)``, the Trainer, a loss from ``model(...)``)."""
        if self._root_task is None or self._defer_all or torch._C._current_graph_task_id() == self._root_task:
            return False
        self._deferred[weight] = None
        if not self._warned_nested:
            self._warned_nested = True
            log.warning("forge: a backward nested in the loss's (a cached loss such as GradCache, or torch.utils."
                        "checkpoint with use_reentrant=True outside transformers' gradient_checkpointing_enable) "
                        "brings fused weights part of their gradient: the parts are summed in .grad and applied once "
                        "when the loss's backward ends, exact, without FORGE's memory saving for them. For "
                        "checkpointing, use_reentrant=False keeps it.")
        return True

    def _linear_plan(self, weight: Tensor) -> _LinearPlan:
        """What a linear weight's update needs besides its inputs, worked out once: on a GPU at small batch the host's
        time per layer is the step's time (``python -m benchmarks.forge_host``). Rebuilt when ``MEMGRAD_BACKEND``
        changes; dropped by :meth:`load_state_dict` (new state tensors)."""
        forced = forced_backend()
        plan = self._plans.get(weight)
        if (plan is not None and plan.forced == forced and plan.contiguous == weight.is_contiguous()
                and plan.rule == self.rule and plan.shape == weight.shape):
            return plan
        st = self._state(weight)
        plan = _LinearPlan(
            forced=forced, contiguous=weight.is_contiguous(), state=st,
            rule_state=_rule_state(st),
            rows=self._linear_rows(weight), impl=self._weight_step_impl(weight),
            position=self._group_index_pos[weight], rule=self.rule, shape=weight.shape,
        )
        self._plans[weight] = plan
        return plan

    def _linear_rows(self, weight: Tensor) -> int:
        """Rows per weight-gradient tile of a linear weight."""
        return K.row_tiles(weight.shape[0], weight.shape[1], self._tile_bytes(weight, linear=True))

    # Row blocks of a weight gradient pushed to the optimizer one at a time (embedding, chunked LM head).

    def _begin_blocks(self, weight: Tensor) -> dict[str, Any] | None:
        """Start a weight's blockwise step; None when this backward does not apply updates (accumulating, or a weight
        whose gradient has other parts: its blocks join .grad, and the hook applies the sum)."""
        if not self._is_sync() or weight in self._shared or self._nested_part(weight):
            return None
        if self._mode == "norm":
            return {"acc": self._accumulated(weight)}
        blk: dict[str, Any] = {"acc": weight.grad}  # gradient accumulated over earlier micro-batches, if any
        weight.grad = None
        if self._mode == "apply":
            coef, st = self._clip_coef(weight), self._state(weight)
            self._note_update(weight)
            blk.update(step=_next_step(st), coef=coef, st=st, hp=self._hp(weight))
            blk["seed"] = _noise_seed(self._group_index_pos[weight], blk["step"])
        return blk

    def _apply_block(self, weight: Tensor, blk: dict[str, Any] | None, r0: int, r1: int, g: Tensor,
                     held: bool = False) -> None:
        if blk is None:  # accumulating: the block joins weight.grad
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad[r0:r1] += g
            return
        # a bf16 block of an fp32 weight under autocast: cast as autograd casts the gradient, before clipping scales
        # it (as clip_grad_norm_ scales the fp32 .grad)
        given = g
        if g.dtype != weight.dtype:
            g = g.to(weight.dtype)
        if blk["acc"] is not None:
            g = g + blk["acc"][r0:r1]
        held = held and g is given  # (a new tensor would live until the replay's end: launched now instead)
        if self._mode == "norm":
            self._measure(g, weight)
            return
        if self._mode == "skip":
            return
        names = K.RULES[self.rule][1]
        whole = r0 == 0 and r1 == weight.shape[0]  # (a slice is a dispatch per tensor: skipped where it is the whole)
        self._update(weight, weight.data if whole else weight.data[r0:r1], g, K.state_slice(blk["st"], names, r0, r1),
                     blk["hp"], blk["step"], blk["coef"], blk["seed"], r0 * math.prod(weight.shape[1:]), held)

    def _embedding_weight_backward(self, weight: Tensor, ids: Tensor, dy: Tensor, padding_idx: int | None) -> None:
        """Called from the fused embedding's backward: the dense gradient is built and applied per row block."""
        nested = self._nested_part(weight)  # (then its blocks join .grad: _begin_blocks)
        if not nested:
            self._in_layer.add(weight)
        # With the device kernels (GPU), boolean selection would wait for the host once per block: mask instead
        # (every token's row is added to every block, zeroed where it belongs elsewhere; cheap next to the update).
        if self._mode == "norm" and not nested:
            self._record(self._embedding_weight_backward, weight, ids, dy, padding_idx)
        select = default_backend("forge", dy.device) != "triton"
        if padding_idx is not None:  # nn.Embedding's padding row gets no gradient
            keep = ids != padding_idx
            ids, dy = (ids[keep], dy[keep]) if select else (ids, torch.where(keep[:, None], dy, 0))
        dy = dy.to(weight.dtype)
        rows = K.row_tiles(weight.shape[0], weight.shape[1], self._tile_bytes(weight))
        blk = self._begin_blocks(weight)
        for r0 in range(0, weight.shape[0], rows):
            r1 = min(r0 + rows, weight.shape[0])
            sel = (ids >= r0) & (ids < r1)
            g = torch.zeros(r1 - r0, weight.shape[1], dtype=weight.dtype, device=weight.device)
            if select:
                g.index_add_(0, ids[sel] - r0, dy[sel])
            else:
                g.index_add_(0, (ids - r0).clamp_(0, r1 - r0 - 1), torch.where(sel[:, None], dy, 0))
            self._apply_block(weight, blk, r0, r1, g)

    def _head_weight_consumer(self, weight: Tensor) -> Any:
        """For a chunked LM head whose weight this optimizer updates: receives its gradient in vocabulary blocks."""
        if weight not in self._fused or weight._backward_hooks:  # (a gradient hook sees the whole gradient)
            return None
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1 and self._pending(weight):
            self._mark_shared(weight, "is used more than once before one backward (two losses through the chunked "
                                      "head, or the head and its plain forward)", fixed=False)
        if weight in self._shared:  # autograd sums its parts, the hook applies them
            return None
        state: dict[str, Any] = {}

        def consume(v0: int, v1: int, dw: Tensor, db: Tensor | None) -> None:
            state["done"] = True  # its backward has begun (_pending; not an attribute of consume: a cycle would
            self._in_layer.add(weight)  # keep a dropped graph's consumer alive until the next garbage collection)
            if v0 == 0:
                state["blk"] = self._begin_blocks(weight)
            self._apply_block(weight, state["blk"], v0, v1, dw)

        consume.state = state  # type: ignore[attr-defined]
        consume.applies_update = True  # type: ignore[attr-defined]  (not under torch.autograd.grad: see functional)
        if torch.is_grad_enabled():
            self._note_use(weight, consume)

        consume.hold = functools.partial(self._hold_head_grad, weight)  # type: ignore[attr-defined]  (the head's call)
        # a recording norm pass (clip_pass="replay") keeps the head's block walk, replayed once the norm is known;
        # or, where the blocks fit under the peak so far (as a linear layer's tiles), the blocks themselves: the
        # replay then applies them instead of recomputing the logits
        # (a weight found shared after this loss was built sends its blocks to .grad instead: nothing to replay)
        consume.defer = lambda fn, *a: weight not in self._shared and self._record(fn, *a)  # type: ignore
        consume.keep = lambda: (weight not in self._shared and self._replays is not None  # type: ignore
                                and self._may_keep(weight))
        return consume

    def _hold_head_grad(self, weight: Tensor, tokens: int | None = None) -> bool:
        """Whether the chunked head holds the gradient it computed in forward for a loss over ``tokens`` positions.
        ``"auto"``: on the torch path (CPU), when that fp32 buffer is no larger than the blocks recomputing would
        allocate anyway for that many tokens (``tokens=None``: at most 36 MiB) — the same memory for the head's usual
        flops (a hidden-256 head at vocab 32768, 2048 tokens, fp32 on CPU: 0.45 s forward + backward held against
        0.88 s recomputed, whose extra GEMM has a 256-deep contraction, the slowest shape there; at 64 tokens the
        held buffer was 15 MB over recomputing's blocks). On a GPU (Triton head) recompute, until measured there."""
        if self.head_grad != "auto":
            return self.head_grad == "hold"
        room = _HOLD_MAX_BYTES if tokens is None else vocab_walk_bytes(tokens, weight.shape[0], weight.shape[1])
        return default_backend("head", weight.device) == "torch" and 4 * weight.numel() <= room

    def _weight_step_impl(self, weight: Tensor):
        """The Triton kernel on CUDA (fp32, bf16 or 8-bit state; nearest or stochastic rounding: the same noise as
        the twin), else the torch twin."""
        if (default_backend("forge", weight.device) == "triton" and weight.is_contiguous()
                and self.rule in K.KERNEL_RULES and weight.dtype != torch.float64):  # (the kernels compute in fp32)
            from memgrad_hf.kernels import forge_triton

            split = self._linear_kernel(weight) == "split"
            return forge_triton.linear_weight_step_split if split else forge_triton.linear_weight_step
        return K.linear_weight_step


    def _hook_new(self) -> None:
        """Parameters of the groups that did not require grad when the hooks were set (unfrozen since, or added by
        add_param_group): hook those that do now (the hook path; their layers are not fused)."""
        if not self._unhooked:
            return
        for p in self._unhooked:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
                self._hooked.add(p)
        self._unhooked = [p for p in self._unhooked if p not in self._hooked]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim``'s; the added parameters are updated by the hook path (their layers are not fused)."""
        check_torch_options(type(self).__name__, {k: v for k, v in param_group.items() if k in RESULT_OPTIONS})
        super().add_param_group(param_group)
        if not hasattr(self, "_group_index"):  # (the constructor's own groups)
            return
        for p in self.param_groups[-1]["params"]:
            self._group_index[p] = len(self.param_groups) - 1
            self._group_index_pos[p] = len(self._group_index_pos)
            if self._attached:
                self._unhooked.append(p)
        self._hook_new()

    def _accumulated(self, p: Tensor) -> Tensor | None:
        """In the norm pass: the gradient ``p`` accumulated over earlier micro-batches, the first time it is asked
        for (then None: it is counted once)."""
        if p in self._stash_counted:
            return None
        self._stash_counted.add(p)
        return self._stash.get(p)

    def _on_grad(self, p: Tensor, held: bool = False) -> None:
        if p.grad is None or not self._is_sync():  # fused weights reach here with no gradient: nothing to do
            return
        if self._root_task is not None and (self._defer_all or torch._C._current_graph_task_id() != self._root_task):
            self._deferred[p] = None  # (maybe) part of the gradient, from a nested backward: the rest may follow
            return
        if p in self._fused and p not in self._shared and p in self._in_layer:
            # a gradient from a use outside the layer, which arrives after the layer's own fused update: this step
            # applies the two separately; from the next step on the parts are summed first (exact). (Without the
            # layer's own backward this step, the hook's gradient is the whole gradient: one update, exact.)
            self._mark_shared(p, "is also used outside its layer (e.g. a penalty on the weight in the loss), found "
                                 "only as this step applied that part of its gradient as a second update "
                                 "(optimizer.backward(loss) and the Trainer find the uses in the first backward's "
                                 "graph before any update; a use added later is found here)")
            # (the same backward's second part, not "a second backward" to warn about; in the norm pass both parts
            # are applied later, by the replay, one after the other)
            if self._mode == "norm":
                self._second_parts.add(p)
            else:
                self._applied.discard(p)
        if p.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients: use "
                               "nn.Embedding(sparse=False), or torch.optim.SparseAdam for that embedding.")
        if self._mode == "norm":
            acc = self._accumulated(p)
            self._measure(p.grad if acc is None else p.grad + acc, p)
            self._record(self._replay_grad, p, p.grad)
            p.grad = None
            return
        g, p.grad = p.grad, None
        if self._mode == "skip":
            return
        self._apply(p, g, held)

    # ------------------------------------------------------------------------------------------- Optimizer API

    @torch.no_grad()
    def _outside_norm_sq(self) -> float:
        """Under the Trainer, the squared norm of the gradients of trainable parameters outside the groups (unfrozen
        after the optimizer was built): never updated, but the Trainer's norm is over ``model.parameters()``. (The
        norm pass counts them itself; this is for steps without one.)"""
        if not self._trainer_managed or self.model is None:
            return 0.0
        return sum(float(p.grad.detach().float().square().sum()) for p in self.model.parameters()
                   if p.requires_grad and p.grad is not None and p not in self._group_index)

    def _hyperparameters(self) -> list[dict[str, Any]]:
        # (a tensor lr is changed in place by torch's schedulers: its value, not the tensor)
        return [{k: v.clone() if isinstance(v, Tensor) else v for k, v in g.items() if k != "params"}
                for g in self.param_groups]

    def _warn_late_hyperparameters(self) -> None:
        """torch.optim reads the groups in step(); FORGE read them when it applied the update, in backward. A value
        changed in between (a Trainer callback's on_pre_optimizer_step, a loop setting the lr after backward) is
        said to apply from the next step, not silently ignored for this one."""
        used, now = self._hp_used, self._hyperparameters()
        if used != now and not self._warned_late_hp:
            self._warned_late_hp = True
            changed = sorted({k for u, n in zip(used, now, strict=False) for k in n if u.get(k) != n[k]})
            log.warning(
                "%s: %s changed between backward and step() (e.g. in a Trainer callback's on_pre_optimizer_step, or "
                "set after loss.backward()): FORGE applied this step's update inside backward with the previous "
                "values; the new ones apply from the next step. Change hyperparameters before the forward (a "
                "callback's on_step_begin) for them to apply to the step.", type(self).__name__,
                ", ".join(changed) or "the param groups")

    def step(self, closure: Any = None) -> Any:
        """The updates already happened in backward; this closes the step (bookkeeping, logging)."""
        if self._grouped:  # (a backward that raised before its end launched them)
            self._launch_grouped()
        if self._applied and self._hp_used is not None:
            self._warn_late_hyperparameters()
        self._hp_used = None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.sync is False and not self._warned_nosync:
            self._warned_nosync = True
            log.warning(
                "%s.step() with optimizer.sync = False: the gradients went into .grad and no update was applied. Set "
                "optimizer.sync = True (or None) before the backward of the micro-batch that should update.",
                type(self).__name__)
        if self.sync is None and not self._is_sync() and not self._warned_nosync:
            self._warned_nosync = True  # (accelerate's wrapper skips step() there: this is a direct call)
            log.warning(
                "%s.step() while accelerate's GradientState says this micro-batch does not sync (sync_gradients="
                "False, e.g. left so by an accelerator.accumulate() block that was interrupted): the gradients went "
                "into .grad and no update was applied. Step at the sync micro-batch, or set opt.sync = True in a "
                "loop without accumulation.", type(self).__name__)
        # trainable since the hooks were set: their gradient waited in .grad (applied below), hooked from now on
        late = self._is_sync() and any(p.grad is not None for p in self._unhooked)
        # gradients still deferred (a root left over from a backward that raised made a later backward without a
        # root defer them): complete by now, applied here rather than lost
        self._leave()
        if self._is_sync():
            self._apply_unreached()
        if late:
            self._hook_new()
        self._report_shared()
        self._applied.clear()
        self._second_parts.clear()
        self._in_layer.clear()
        self._shared = set(self._shared_fixed)  # marks found at forward hold for their step only
        self._compiled_uses.clear()
        now, bad = 0.0, 0
        for key, (norm_sq, skipped) in self._step_sums.items():  # one host read per device and step
            now += 0.0 if isinstance(key, tuple) else float(norm_sq)  # (the Trainer's norm leaves "unclipped" out)
            bad += int(skipped)
            norm_sq.zero_(), skipped.zero_()
        if self.max_grad_norm <= 0 or self.clip == "previous":
            now += self._outside_norm_sq()
            self.last_grad_norm = math.sqrt(now) if math.isfinite(now) else float("nan")
            self._prev_norm = self.last_grad_norm
        if bad:
            self._nonfinite_seen = True
        if self._nonfinite_seen:
            self.skipped_steps += 1
            log.warning("forge: non-finite gradients were not applied (tensors skipped; %d steps affected so far)",
                        self.skipped_steps)
            self._nonfinite_seen = False
        self._mode = "apply"
        self._norm_pass_seen = False
        return loss

    def _apply_unreached(self) -> None:
        """Parameters the sync backward did not reach whose gradient waits in ``.grad`` (accumulated over earlier
        micro-batches: an MoE expert, a task head or a branch the last micro-batch does not use; or unfrozen since
        the hooks were set, so that no hook took it): updated from it
        here, as ``torch.optim`` steps every parameter with a ``.grad`` (with exact clipping the norm pass counted
        them). Every gradient a backward reached was consumed by its update; after a skipped step, dropped."""
        for p in self._group_index:
            if p.grad is not None and p.requires_grad and p not in self._applied:
                g, p.grad = p.grad, None
                if self._mode != "skip":
                    self._apply(p, g)

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()`` with exact clipping for losses computed outside the model's forward; the first call also
        finds fused weights that the loss uses more than once (:meth:`scan_uses`)."""
        self.scan_uses(loss)
        if self.needs_norm_pass and loss.dim() > 0 and self._is_sync():  # clip_root takes scalars
            self._norm_pass(loss, torch.ones_like(loss))
        else:
            loss = self.clip_root(loss)
        loss.backward()


        # load_state_dict replaces the param_group dicts; our index maps params to positions, still valid.


class ForgeAdamW(ForgeOptimizer):
    """AdamW applied inside the backward pass (FORGE). In fp32 the result equals ``torch.optim.AdamW``.

    Args:
        params: parameters or parameter groups (as for ``torch.optim.AdamW``).
        model: the ``nn.Module`` those parameters belong to (its ``nn.Linear`` layers get the fused backward);
            ``forge_model=`` is the same, under a keyword that the Trainer's ``optimizer_cls_and_kwargs`` and PEFT's
            ``create_loraplus_optimizer`` leave free.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        max_grad_norm: global-norm clipping threshold (0 = off).
        clip: ``"exact"`` (the global norm is measured before any update) or ``"previous"`` (the previous step's
            norm).
        clip_pass: how ``clip="exact"`` measures the norm first: ``"replay"`` (one backward that measures the norm
            and records each update, replayed at its end: weight-gradient tiles, the chunked head's blocks
            included, are kept for the replay where they fit under the peak memory so far, else formed twice; each
            linear layer's ``dY`` is kept until the replay), ``"backward"`` (a norm-only backward, then the update
            backward: no extra memory, a second backward) or ``"auto"`` (default: replay, except under gradient
            checkpointing, where recording would keep the recomputed activations alive).
        state_dtype: ``None``/``"auto"`` (default: like ``torch.optim``, state in the weight's precision: fp32 for
            fp32 weights, bf16 for bf16/fp16 ones, second moment rounded stochastically), ``"fp32"``, ``"bf16"`` or
            ``"8bit"`` (matrices: block-scaled 8-bit float codes, e3m4 for ``m``, e3m5 for ``sqrt(v)``; see
            :mod:`memgrad_hf.kernels.state_codes`). A checkpoint resumes under another ``state_dtype`` too (its
            state converted).
        stochastic_rounding: round bf16 weights stochastically after each update.
        tile_bytes: bytes of one weight-gradient tile, counted as fp32 (default: 4 MiB on CPU, 64 MiB on a GPU,
            256 MiB for linear layers that ``kernel`` serves by cuBLAS tiles).
        head_grad: with ``patch_model``'s chunked head: ``"recompute"`` (its logits are recomputed in backward, so
            its weight gradient never exists whole; a third more head flops), ``"hold"`` (the gradient computed in
            forward is held until the head's backward: the head's usual flops, one fp32 ``[V x H]`` buffer
            meanwhile) or ``"auto"`` (default: hold on CPU where that buffer is at most 36 MiB, no more than
            recomputing allocates for its blocks; else recompute).
        kernel: on a GPU, ``"fused"`` (each weight-gradient tile is computed in the Triton kernel's registers and
            updated in its epilogue), ``"split"`` (row tiles of ``dW`` by cuBLAS, each then updated by the update
            kernel: the library's GEMM, one tile of ``dW`` in memory) or ``"auto"`` (default: split for weights of
            at least 4096 x 4096 elements, faster there on an H100). Same results; on CPU the torch path runs either
            way.

    Example::

        from memgrad_hf.optim import ForgeAdamW
        opt = ForgeAdamW(model.parameters(), model=model, lr=1e-4, weight_decay=0.01)
        for batch in data:
            model(**batch).loss.backward()   # weights are updated here
            opt.step()                        # closes the step (bookkeeping); no gradient is stored
    """

    rule = "adamw"

    def __init__(self, params: Iterable[Any], model: nn.Module | None = None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 **kwargs: Any) -> None:
        check_hp(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), model=model,
                         **kwargs)


class ForgeLion(ForgeOptimizer):
    """Lion applied inside the backward pass (FORGE). One state tensor per parameter.

    Example::

        from memgrad_hf.optim import ForgeLion
        opt = ForgeLion(model.parameters(), model=model, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)
    """

    rule = "lion"

    def __init__(self, params: Iterable[Any], model: nn.Module | None = None, lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, **kwargs: Any) -> None:
        check_hp(lr, betas, 0.0, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), model=model, **kwargs)


class ForgeSGD(ForgeOptimizer):
    """SGD (with momentum, dampening, Nesterov, L2 weight decay) applied inside the backward pass (FORGE): LOMO's
    idea, but tile by tile with exact clipping. In fp32 the result equals ``torch.optim.SGD``. With ``momentum=0``
    (the default, as torch's) it keeps no state at all.

    Example::

        from memgrad_hf.optim import ForgeSGD
        opt = ForgeSGD(model.parameters(), model=model, lr=1e-2, momentum=0.9, nesterov=True)
    """

    def __init__(self, params: Iterable[Any], model: nn.Module | None = None, lr: float = 1e-3,
                 momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 **kwargs: Any) -> None:
        check_hp(lr, (0.0, 0.0), 0.0, weight_decay)
        nesterov = check_flag(type(self).__name__, "nesterov", nesterov)
        if isinstance(params, nn.Module):  # ForgeSGD(model, lr=...), as the other FORGE optimizers take it
            model = params if model is None else model
            params = params.parameters()
        if not 0.0 <= momentum < 1.0 or not 0.0 <= dampening <= 1.0:
            raise ValueError(f"momentum must be in [0, 1) and dampening in [0, 1]; got {momentum}, {dampening}.")
        if nesterov and (momentum == 0 or dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening=0 (as torch.optim.SGD).")
        groups = list(params)
        super().__init__(groups, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov), model=model, **kwargs)

    @property
    def rule(self) -> str:  # type: ignore[override]
        """Momentum state only while some group has momentum: read live, since a scheduler may set it
        (``OneCycleLR(cycle_momentum=True)``, as on ``torch.optim.SGD``); a buffer created then starts at zero, which
        with ``dampening=0`` is torch's first momentum step."""
        return "sgd_momentum" if any(g.get("momentum", 0) != 0 for g in getattr(self, "param_groups", ())) else "sgd"


def forge_optimizer_of(optimizer: Any) -> ForgeOptimizer | None:
    """The :class:`ForgeOptimizer` behind ``optimizer`` (unwrapping accelerate's ``AcceleratedOptimizer``, which the
    Trainer's ``trainer.optimizer`` is), or None for any other optimizer.

    Example::

        opt = forge_optimizer_of(trainer.optimizer)
        if opt is not None: print(opt.skipped_steps)
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, ForgeOptimizer) else None
