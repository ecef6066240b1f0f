"""The generic chunked-head patch for any transformers ``*ForCausalLM`` (masked LMs and encoder-decoders too).

How it works, without a hand-copied forward per model:

1. ``model.forward`` is wrapped (signature preserved, so ``generate`` and the Trainer see the original).
2. In a training forward with ``labels`` the model's own forward runs unchanged, except that for this one call
   its output-embedding module returns a :class:`~memgrad_hf.patches.probe.LogitsProbe` (no data; it records
   the softcap/scale ops the model applies) and its ``loss_function`` is memgrad's.
3. The model calls ``self.loss_function(logits=probe, labels=..., num_items_in_batch=..., ...)`` exactly as it
   would call HF's ``ForCausalLMLoss``; memgrad's loss shifts the labels the same way and computes the loss from
   the captured hidden states with :func:`memgrad_hf.functional.linear_cross_entropy`. (A model that applies
   ``nn.CrossEntropyLoss`` to its own logits, unshifted, gets the same chunked loss from that call.) Whatever the
   model adds to the loss afterwards (MoE auxiliary losses) is added to a real tensor as usual.
4. ``outputs.logits`` is ``None`` for such calls. Evaluation (``model.eval()``) and ``generate`` run the
   original forward and return the same logits as the unpatched model.
"""

from __future__ import annotations

import inspect
import logging
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memgrad_hf.errors import UnsupportedModelError
from memgrad_hf.functional import check_chunk_size, linear_cross_entropy
from memgrad_hf.kernels import head as K
from memgrad_hf.patches.probe import Chain, LogitsProbe
from memgrad_hf.patches.unwrap import present_as_forward

_ATTR = "_memgrad_head"
logger = logging.getLogger(__name__)


@dataclass
class HeadPatch:
    """Bookkeeping stored on a patched model (``model._memgrad_head``)."""

    chunk_size: int | None
    accum_dtype: torch.dtype | None
    original: Any  # the forward callable that was in place before patching
    had_instance_forward: bool
    signature: inspect.Signature = field(repr=False)
    # Set by a FORGE optimizer: weight -> consumer of its gradient in vocabulary blocks (or None)
    weight_consumer_factory: Any = None
    # Set for one Trainer loss (label_smoothing_factor > 0; see memgrad_hf.patches.trainer): the ε of the loss
    label_smoothing: float = 0.0
    grad_in_forward: bool | None = None  # patch_model's option (see linear_cross_entropy); FORGE's consumer overrides
    # False after unpatch_model found the forward wrapped by something installed later (see unpatch_head)
    active: bool = True
    lost_warned: bool = False  # (see head_patch)
    loss_warned: bool = False  # (see _loss_not_served)
    no_labels_warned: bool = False  # skip_logits=True given without labels (said once)


# ------------------------------------------------------------------------------------------ head resolution


def _is_plain_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def resolve_head(head: nn.Module, hidden: torch.Tensor, owner: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(hidden', weight, bias)`` such that ``head(hidden) == hidden' @ weight.T + bias``, differentiably.

    Handles ``nn.Linear``, PEFT LoRA on the head (adapters train: their delta enters the weight, or, with
    active dropout, extra input columns) and PEFT ``modules_to_save``.
    """
    if _is_plain_linear(head):
        return hidden, head.weight, head.bias
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:  # peft absent: only plain heads exist
        LoraLinear = ModulesToSaveWrapper = ()  # type: ignore[assignment]
    if ModulesToSaveWrapper and isinstance(head, ModulesToSaveWrapper):
        active = head.active_adapters
        if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
            return resolve_head(head.original_module, hidden, owner)
        return resolve_head(head.modules_to_save[active[0]], hidden, owner)
    if LoraLinear and isinstance(head, LoraLinear):
        return _resolve_lora(head, hidden, owner)
    raise UnsupportedModelError(
        f"{owner}'s output embeddings are a {type(head).__name__}; memgrad_hf's chunked head supports nn.Linear, "
        "PEFT LoRA and modules_to_save heads. Use patch_model(model, head=False) for this model."
    )


def _check_lora_head(head: nn.Module, owner: str, adapters: Any = None) -> None:
    """Refuse a PEFT LoRA head the chunked head cannot reproduce (``adapters``: those to check, default all)."""
    base = head.get_base_layer()
    if not _is_plain_linear(base):
        raise UnsupportedModelError(f"{owner}: LoRA on an LM head whose base layer is {type(base).__name__}. Use "
                                    "patch_model(model, head=False).")
    if head.fan_in_fan_out:
        raise UnsupportedModelError(f"{owner}: LoRA with fan_in_fan_out=True on the LM head is not supported. Use "
                                    "patch_model(model, head=False).")
    variants = getattr(head, "lora_variant", {})
    for name in head.lora_A if adapters is None else adapters:
        if name in variants:
            raise UnsupportedModelError(
                f"{owner}: the LM head's LoRA adapter {name!r} is a {type(variants[name]).__name__} "
                "variant (e.g. DoRA); memgrad_hf supports vanilla LoRA on lm_head. Drop lm_head from "
                "target_modules or use patch_model(model, head=False)."
            )


def _check_head_adapters(head: nn.Module, owner: str) -> None:
    """At ``patch_model``: the refusals :func:`resolve_head` would raise at the first training forward, for the PEFT
    LoRA adapters the head (or a ``modules_to_save`` copy of it) already has, and for PEFT's trainable-tokens
    wrapper."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.utils.other import TrainableTokensWrapper
    except ImportError:
        return
    if isinstance(head, TrainableTokensWrapper):  # (trainable_token_indices with tied embeddings)
        resolve_head(head, torch.empty(0), owner)  # raises, naming the fix
    for m in head.modules():
        if isinstance(m, LoraLinear):
            _check_lora_head(m, owner)


def _resolve_lora(head: nn.Module, hidden: torch.Tensor, owner: str):
    base = head.get_base_layer()
    weight, bias = base.weight, base.bias
    if head.disable_adapters or head.merged:
        if not _is_plain_linear(base):
            _check_lora_head(head, owner, ())
        return hidden, weight, bias
    _check_lora_head(head, owner, head.active_adapters)
    cols_h, cols_w = [hidden], [weight]
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        a, b = head.lora_A[name], head.lora_B[name]
        if b.bias is not None:  # (lora_bias=True) PEFT scales lora_B's whole output, its bias included
            scaled = b.bias * head.scaling[name]
            bias = scaled if bias is None else bias + scaled
        delta = (b.weight @ a.weight) * head.scaling[name]
        dropout = head.lora_dropout[name]
        if isinstance(dropout, nn.Identity) or not dropout.training:
            cols_w[0] = cols_w[0] + delta.to(weight.dtype)
        else:  # x W + drop(x) Δ  ==  [x, drop(x)] @ [W, Δ]ᵀ  keeps dropout exact
            cols_h.append(dropout(hidden.to(a.weight.dtype)).to(hidden.dtype))
            cols_w.append(delta.to(weight.dtype))
    if len(cols_h) == 1:
        return hidden, cols_w[0], bias
    return torch.cat(cols_h, dim=-1), torch.cat(cols_w, dim=1), bias


# ------------------------------------------------------------------------------------------ capture


@dataclass
class _Capture:
    owner: str
    vocab: int
    hidden: torch.Tensor | None = None
    head_calls: int = 0
    loss_calls: int = 0
    # an nn.Linear subclass head with its own forward: the (weight, bias) its F.linear received (see _traced)
    linear: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # the chunked loss under Trainer's label smoothing, which the forward returns alone (see _chunked_causal_lm_loss)
    smoothed_loss: torch.Tensor | None = None


def _to_head_device(head: nn.Module, x: torch.Tensor, owner: str) -> torch.Tensor:
    """``x`` on the device of the head's weight. Under accelerate's ``device_map`` the head may sit on another device
    than the last decoder layer, and the hook that moves its input there wraps the ``forward`` the probe replaces."""
    w = next(head.parameters(), None)
    if w is None or w.device == x.device:
        return x
    if w.device.type == "meta":
        raise UnsupportedModelError(
            f"{owner}'s LM head weight is offloaded (on the meta device between calls, as accelerate's cpu/disk "
            "offload in device_map leaves it); the chunked head needs it resident through backward. Place lm_head on a "
            "device in device_map (a GPU, or 'cpu'; not 'disk' nor offloaded), or use patch_model(model, head=False)."
        )
    return x.to(w.device)


def _traced(head: nn.Module) -> bool:
    """An ``nn.Linear`` subclass with a forward of its own (e.g. a learned per-word logit scale after its linear):
    its forward runs, with its ``F.linear`` on the head input answered by the probe, so that what it does to the
    logits is recorded like what the model does to them."""
    return isinstance(head, nn.Linear) and type(head).forward is not nn.Linear.forward


class _LinearToProbe(torch.overrides.TorchFunctionMode):
    """Answers the first ``F.linear`` applied to ``x`` with ``probe(x)``, recording its weight and bias in ``cap``."""

    def __init__(self, x: torch.Tensor, cap: _Capture, probe: Any) -> None:
        super().__init__()
        self.x, self.cap, self.probe = x, cap, probe

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and self.cap.linear is None and args and args[0] is self.x:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self.cap.linear = (weight, bias)
            return self.probe(self.x)
        return func(*args, **kwargs)


def _head_out_features(head: nn.Module) -> int:
    if isinstance(getattr(head, "out_features", None), int):
        return head.out_features
    w = getattr(head, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return w.shape[0]
    raise UnsupportedModelError(
        f"the output embeddings ({type(head).__name__}) have no 2-D weight nor out_features, so the chunked head "
        "cannot compute their logits: restore an nn.Linear head, or call memgrad_hf.unpatch_model(model) (or patch "
        "with head=False) to keep this one."
    )


@contextmanager
def capture_head_input(model: nn.Module, patch: HeadPatch | None = None):
    """Within the block ``model``'s output embeddings return a :class:`LogitsProbe` (no logits are computed) and
    record their input: after ``out = model(...)``, ``cap.hidden`` is what the head received and ``out.logits`` a probe
    whose chain is what the forward did to the logits. With a ``patch``, ``model.loss_function`` is memgrad's
    chunked loss meanwhile."""
    owner = type(model).__name__
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModelError(f"{owner}.get_output_embeddings() returned None: no LM head to chunk.")
    cap = _Capture(owner=owner, vocab=_head_out_features(head))

    def probe(x: torch.Tensor) -> LogitsProbe:
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        return LogitsProbe((*x.shape[:-1], cap.vocab), dtype, x.device, Chain(), owner,
                           None if patch is None else cross_entropy)

    def head_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> LogitsProbe:
        cap.head_calls += 1
        if cap.head_calls > 1:
            raise UnsupportedModelError(
                f"{owner} calls its LM head more than once per forward; memgrad_hf cannot chunk it exactly."
            )
        cap.hidden = x = _to_head_device(head, x, owner)
        if not _traced(head):
            return probe(x)
        with _LinearToProbe(x, cap, probe):
            out = type(head).forward(head, x, *args, **kwargs)
        if cap.linear is None or not isinstance(out, LogitsProbe):
            raise UnsupportedModelError(
                f"{owner}'s output embeddings ({type(head).__name__}) "
                + ("never apply F.linear to their input" if cap.linear is None else "do not return their logits")
                + "; memgrad_hf's chunked head cannot reproduce them. Use patch_model(model, head=False)."
            )
        return out

    def cross_entropy(logits: LogitsProbe, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        cap.loss_calls += 1
        return _chunked_own_cross_entropy(head, cap, patch, logits, target, *args, **kwargs)

    original_loss = model.loss_function

    from transformers.loss.loss_utils import ForMaskedLMLoss

    masked_lm = _stock_loss(model) is ForMaskedLMLoss  # its labels are each position's own target: no shift

    def loss_function(logits: Any, labels: Any = None, vocab_size: int | None = None, *args: Any, **kwargs: Any):
        if not isinstance(logits, LogitsProbe):
            return original_loss(logits, labels, vocab_size, *args, **kwargs)
        cap.loss_calls += 1
        if masked_lm:
            kwargs["shift_labels"] = labels
        return _chunked_causal_lm_loss(model, head, cap, patch, logits, labels, vocab_size, *args, **kwargs)

    had_fwd = "forward" in head.__dict__
    prev_fwd = head.__dict__.get("forward")
    had_loss = "_loss_function" in model.__dict__
    prev_loss = model.__dict__.get("_loss_function")
    head.forward = head_forward
    if patch is not None:
        model.loss_function = loss_function
    try:
        yield cap
    finally:
        if had_fwd:
            head.forward = prev_fwd
        else:
            del head.forward
        if patch is not None and had_loss:
            model._loss_function = prev_loss
        elif patch is not None:
            del model._loss_function


def epilogue_args(chain: Chain) -> tuple[float | None, float]:
    """``(softcap, logit_scale)`` for :mod:`memgrad_hf.functional` from the ops a forward applied to its logits."""
    ep = chain.epilogue()
    return (ep.out, ep.inp * ep.out) if ep.tanh else (None, ep.inp)


def _chunked_causal_lm_loss(
    model: nn.Module,
    head: nn.Module,
    cap: _Capture,
    patch: HeadPatch,
    logits: LogitsProbe,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_: Any,
) -> torch.Tensor:
    """``ForCausalLMLoss`` semantics (label shift, ``ignore_index``, ``num_items_in_batch``, ``shift_labels``); a
    masked LM's loss passes its labels as ``shift_labels`` (``ForMaskedLMLoss``: no shift)."""
    chain: Chain = logits._chain
    hidden = chain.rows(cap.hidden)
    v = chain.vocab_limit or logits.shape[-1]
    if vocab_size is not None and vocab_size != v:
        raise UnsupportedModelError(
            f"{cap.owner}: loss called with vocab_size={vocab_size} but the LM head produces {v} logits."
        )
    if shift_labels is None:
        labels = F.pad(labels.to(hidden.device), (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if shift_labels.shape != hidden.shape[:-1]:
        if shift_labels.numel() != hidden.shape[:-1].numel():
            raise ValueError(
                f"labels give targets of shape {tuple(shift_labels.shape)} but the LM head saw hidden states of shape "
                f"{tuple(hidden.shape[:-1])}: pass labels shaped like input_ids (with logits_to_keep, for the kept "
                "positions only)."
            )
        shift_labels = shift_labels.reshape(hidden.shape[:-1])  # as the stock loss flattens both (1-D labels)
    loss = _chunked_cross_entropy(head, cap, patch, chain, hidden, shift_labels, ignore_index=ignore_index,
                                  label_smoothing=patch.label_smoothing, num_items_in_batch=num_items_in_batch)
    if patch.label_smoothing:
        # Stock Trainer smooths by popping the labels: the model then adds no loss terms of its own (an MoE's router
        # loss), so the forward returns this loss alone; the model gets a copy, which it may add to in place.
        cap.smoothed_loss = loss
        return loss.clone()
    return loss


def head_operands(head: nn.Module, hidden: torch.Tensor, owner: str, chain: Chain,
                  linear: tuple[torch.Tensor, torch.Tensor | None] | None = None):
    """``(hidden', weight, bias, softcap, logit_scale)`` that reproduce ``head(hidden)`` followed by what the
    forward did to the logits (``chain``), for :mod:`memgrad_hf.functional`. ``linear``: the weight and bias a
    traced head module's ``F.linear`` received (``_Capture.linear``)."""
    h, weight, bias = resolve_head(head, hidden, owner) if linear is None else (hidden, *linear)
    _require_whole(weight, owner)
    if chain.column_ops:
        weight, bias = K.fold_column_ops(weight, bias, chain.column_ops)
    if chain.vocab_limit is not None:
        weight = weight[: chain.vocab_limit]
        bias = None if bias is None else bias[: chain.vocab_limit]
    return (h, weight, bias, *epilogue_args(chain))


def _require_whole(weight: torch.Tensor, owner: str) -> None:
    """The head's weight must be whole when the loss runs. A head sharded as an FSDP unit of its own (FSDP2
    ``fully_shard(model.lm_head)``) or partitioned by DeepSpeed ZeRO-3 is gathered only around its own forward, which
    memgrad replaces by a probe; kept in the root unit (the default auto-wrap policies), it is whole (tested)."""
    if type(weight).__name__ == "DTensor" or (hasattr(weight, "ds_id") and weight.numel() == 0):
        raise UnsupportedModelError(
            f"{owner}'s LM head weight is sharded ({type(weight).__name__} of shape {tuple(weight.shape)}) when its "
            "loss runs: the head is an FSDP unit of its own (fully_shard(model.lm_head)), tensor-parallel, or a "
            "DeepSpeed ZeRO-3 partition, gathered only for its own forward. Keep lm_head whole in the root FSDP unit "
            "(do not shard it separately; FSDP1/FSDP2 with the transformer-layer auto-wrap policy work), use ZeRO-2, "
            "or patch_model(model, head=False)."
        )


# opaque to torch.compile as a whole, as linear_cross_entropy is: the FORGE consumer it builds is Python bookkeeping
# (sets of parameters) that dynamo would break the graph inside of
@torch.compiler.disable
def _chunked_cross_entropy(head: nn.Module, cap: _Capture, patch: HeadPatch, chain: Chain, hidden: torch.Tensor,
                           targets: torch.Tensor, **loss_kwargs: Any) -> torch.Tensor:
    h, weight, bias, softcap, scale = head_operands(head, hidden, cap.owner, chain, cap.linear)
    consumer = head_weight_consumer(patch, head, weight, bias)
    # FORGE may have the gradient computed in forward and held (one fp32 weight-sized buffer): only for a head that
    # runs in fp32, where that is the very path its plain backward takes. A bf16 head (weights, or autocast) sums
    # its gradient in vocabulary blocks in backward, and a held one would be rounded otherwise.
    low = weight.dtype in (torch.bfloat16, torch.float16) or (
        torch.is_autocast_enabled(h.device.type) and torch.get_autocast_dtype(h.device.type) != torch.float32)
    hold = callable(getattr(consumer, "hold", None)) and not low and consumer.hold(targets.numel())
    return linear_cross_entropy(
        h, weight, targets, bias=bias, softcap=softcap, logit_scale=scale, chunk_size=patch.chunk_size,
        accum_dtype=patch.accum_dtype, weight_grad_consumer=consumer,
        grad_in_forward=True if hold else (patch.grad_in_forward if consumer is None else None),
        **loss_kwargs,
    )


def _chunked_own_cross_entropy(
    head: nn.Module,
    cap: _Capture,
    patch: HeadPatch,
    logits: LogitsProbe,
    target: torch.Tensor,
    weight: Any = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy(logits.view(-1, V), target)`` as a model computes it itself (no label shift: the labels
    are the targets of each position, as in the decoders of bart, whisper, ...), in chunks."""
    if weight is not None or size_average is not None or reduce is not None:
        raise UnsupportedModelError(
            f"{cap.owner} calls cross_entropy with class weights or legacy size_average/reduce arguments; the chunked "
            "head does not reproduce those. Use patch_model(model, head=False)."
        )
    if patch.label_smoothing:
        raise UnsupportedModelError(
            f"{cap.owner} computes its own cross-entropy on unshifted labels, while Trainer's label_smoothing_factor "
            "smooths the logits against shifted labels; memgrad_hf cannot reproduce that combination. Drop label "
            "smoothing or use patch_model(model, head=False)."
        )
    hidden = logits._chain.rows(cap.hidden)  # the positions of these logits (a model may select some itself)
    if logits.shape[:-1].numel() != hidden.shape[:-1].numel() or target.numel() != hidden.shape[:-1].numel():
        raise UnsupportedModelError(
            f"{cap.owner} applies cross_entropy to logits of shape {tuple(logits.shape)} with targets of shape "
            f"{tuple(target.shape)}; memgrad_hf needs one target per position the LM head saw "
            f"({tuple(hidden.shape[:-1])})."
        )
    loss = _chunked_cross_entropy(head, cap, patch, logits._chain, hidden.reshape(-1, hidden.shape[-1]),
                                  target.reshape(-1).to(hidden.device), ignore_index=ignore_index,
                                  label_smoothing=label_smoothing, reduction=reduction)
    # F.cross_entropy returns the logits' dtype (a bf16 model's own loss is bf16: computed in fp32 here, then
    # rounded), except under autocast, whose policy runs it in fp32
    return loss.to(torch.float32 if torch.is_autocast_enabled(hidden.device.type) else logits.dtype)


def head_weight_consumer(patch: HeadPatch, head: nn.Module, weight: torch.Tensor, bias: Any) -> Any:
    """A FORGE consumer of the head weight's gradient in vocabulary blocks, only when ``weight`` is the head's own
    Parameter (no LoRA delta, no vocabulary slice or scaled copy) and there is no bias; None otherwise."""
    if patch.weight_consumer_factory is None or bias is not None:
        return None
    if not isinstance(weight, nn.Parameter) or weight is not getattr(head, "weight", None):
        return None
    return patch.weight_consumer_factory(weight)


# ------------------------------------------------------------------------------------------ install


def _strip_probes(out: Any) -> Any:
    if isinstance(out, tuple):
        return tuple(None if isinstance(o, LogitsProbe) else o for o in out)
    if hasattr(out, "keys"):
        for k in list(out.keys()):
            if isinstance(out[k], LogitsProbe):
                out[k] = None
    return out


def _patched_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    patch: HeadPatch = getattr(self, _ATTR)
    skip_logits = kwargs.pop("skip_logits", None)
    if not patch.active:
        return patch.original(*args, **kwargs)
    labels = kwargs.get("labels")
    if labels is None and args:
        labels = patch.signature.bind_partial(*args, **kwargs).arguments.get("labels")
    chunked = labels is not None and (
        bool(skip_logits) if skip_logits is not None else (self.training and torch.is_grad_enabled())
    )
    if skip_logits and labels is None and not patch.no_labels_warned:  # (Liger raises here)
        patch.no_labels_warned = True
        logger.warning("memgrad_hf: %s(..., skip_logits=True) without labels: the chunked head computes a loss from "
                       "labels and has none, so this forward builds the full logits, as the unpatched model does. "
                       "Pass labels to skip them.", type(self).__name__)
    if chunked:
        problem = _loss_not_served(self)
        if problem:  # set after patch_model: the model's own loss, on full logits
            if not patch.loss_warned:
                patch.loss_warned = True
                logger.warning("memgrad_hf: %s %s (set after patch_model): this model runs its stock forward with full "
                               "logits from now on. Call memgrad_hf.patch_model(model, head=False) to remove the "
                               "chunked head explicitly (a Titans memory stays; unpatch_model removes everything).",
                               type(self).__name__, problem)
            chunked = False
    if not chunked:
        return patch.original(*args, **kwargs)
    with capture_head_input(self, patch) as cap:
        out = patch.original(*args, **kwargs)
    if cap.head_calls == 0:
        raise UnsupportedModelError(
            f"{cap.owner}.forward never called its output embeddings module (get_output_embeddings()); "
            "memgrad_hf cannot find the LM head of this model."
        )
    if cap.loss_calls == 0 and _output_loss(out) is None:  # the model chose to compute no loss for this call
        raise ValueError(
            f"{cap.owner}.forward got labels but returned no loss (it computes its loss only with other inputs too, "
            "e.g. BertForPreTraining's next_sentence_label): pass those as well, or call it with skip_logits=False "
            "for its logits without a loss, as the unpatched model returns them."
        )
    if cap.loss_calls == 0:
        raise UnsupportedModelError(
            f"{cap.owner}.forward got labels but computed no loss through self.loss_function; memgrad_hf's chunked "
            "head needs that standard transformers call. Use patch_model(model, head=False)."
        )
    return _strip_probes(out if cap.smoothed_loss is None else _with_loss(out, cap.smoothed_loss))


def _output_loss(out: Any) -> Any:
    if isinstance(out, tuple):
        return out[0] if out and isinstance(out[0], torch.Tensor) and out[0].dim() == 0 else None
    return out.get("loss") if hasattr(out, "get") else getattr(out, "loss", None)


def _with_loss(out: Any, loss: torch.Tensor) -> Any:
    if isinstance(out, tuple):
        return (loss, *out[1:])
    out["loss"] = loss
    return out


def validate(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` if ``model`` lacks what the generic head patch needs."""
    owner = type(model).__name__
    try:
        from transformers import PreTrainedModel
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise UnsupportedModelError("transformers is required to patch a model") from e
    if not isinstance(model, PreTrainedModel):
        if isinstance(getattr(model, "_orig_mod", None), PreTrainedModel):  # torch.compile(model)'s wrapper
            raise UnsupportedModelError(
                f"{owner} is torch.compile's wrapper around a {type(model._orig_mod).__name__}: patch the model before "
                "compiling it (patch_model(model); model = torch.compile(model)), or compile in place with "
                "model.compile() after patching."
            )
        raise UnsupportedModelError(f"{owner} is not a transformers PreTrainedModel; pass a *ForCausalLM (or "
                                    "*ForMaskedLM) model.")
    head = model.get_output_embeddings()
    if head is None:
        scoring = type(model).__name__.endswith(("ForSequenceClassification", "ForTokenClassification",
                                                 "ForQuestionAnswering"))
        raise UnsupportedModelError(
            f"{owner} has no output embeddings (get_output_embeddings() is None), so no LM head to chunk"
            + (": a scoring head (a reward model, a classifier) builds no [tokens x vocab] logits, so there is "
               "nothing for the chunked head to save. FORGE optimizers (optim='forge_adamw') train it as they are; "
               "patch_model(model, head=False, titans=...) still adds Titans memory to it." if scoring else
               ": pass the *ForCausalLM (or *ForMaskedLM) model, not the bare backbone. A model with a scoring head "
               "(a reward model, *ForSequenceClassification) builds no [tokens x vocab] logits; "
               "patch_model(model, head=False) still adds Titans memory to it.")
        )
    if isinstance(head, nn.Embedding):  # (fsmt: its decoder's input embedding, the logits made by another module)
        raise UnsupportedModelError(
            f"{owner}.get_output_embeddings() returns an nn.Embedding, not the module that computes the logits: "
            "memgrad_hf cannot find its LM head. Use patch_model(model, head=False)."
        )
    if "labels" not in inspect.signature(type(model).forward).parameters:
        raise UnsupportedModelError(f"{owner}.forward takes no `labels`; it is not a causal or masked LM with a loss.")
    _check_head_adapters(head, owner)
    problem = _loss_not_served(model)
    if problem:
        raise UnsupportedModelError(f"{owner} {problem}. Use patch_model(model, head=False), or compute your loss "
                                    "with memgrad_hf.functional.")


def _stock_loss(model: nn.Module) -> Any:
    """The transformers loss function the model's ``loss_type`` names (``ForCausalLMLoss`` when it names none)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    return LOSS_MAPPING.get(getattr(model, "loss_type", None) or "ForCausalLM", ForCausalLMLoss)


def _loss_not_served(model: nn.Module) -> str:
    """Why the model's loss is not a cross-entropy the chunked head computes (the causal LM's on shifted labels, or
    the masked LM's on unshifted ones), from a ``loss_type`` or a ``loss_function`` set on it, or "". Checked when
    patching and again per chunked forward: one set afterwards must not be bypassed."""
    from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

    if _stock_loss(model) not in (ForCausalLMLoss, ForMaskedLMLoss):
        return (f"uses loss_type={model.loss_type!r}; memgrad_hf's chunked head reproduces the cross-entropy of causal "
                "and masked LMs (ForCausalLMLoss, ForMaskedLMLoss) only")
    if "_loss_function" in model.__dict__:
        return "has a custom loss_function set; the chunked head would bypass it"
    return ""


def patch_head(model: nn.Module, *, chunk_size: int | None = None, accum_dtype: torch.dtype | None = None,
               grad_in_forward: bool | None = None) -> None:
    """Replace ``model.forward`` (a ``*ForCausalLM``) by one that computes the loss with the chunked head when labels
    are given; the head-only part of :func:`memgrad_hf.patch_model` (which also hooks the Trainer and resolves PEFT
    wrappers: prefer it). Patching again only updates the options. Raises :class:`UnsupportedModelError` for a model
    the probe cannot verify.

    Example::

        patch_head(model, chunk_size=1024)   # options as memgrad_hf.patch_model's
        out = model(input_ids=ids, labels=ids)   # out.loss as HF's; out.logits is None in training
    """
    check_chunk_size(chunk_size)
    # (which of these fits is checked at each forward, against the head weight's dtype then: fp32 or that dtype)
    if accum_dtype not in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"accum_dtype must be None, torch.float32 or the weight dtype; got {accum_dtype!r}.")
    if grad_in_forward is not None and not isinstance(grad_in_forward, bool):
        raise ValueError(f"grad_in_forward must be None, True or False; got {grad_in_forward!r}.")
    existing: HeadPatch | None = getattr(model, _ATTR, None)
    if existing is not None and _forward_lost(model):
        delattr(model, _ATTR)  # an unpickled model: patched again from scratch
    elif existing is not None:  # patching twice only updates the options (and undoes a deferred unpatch)
        existing.chunk_size, existing.accum_dtype, existing.active = chunk_size, accum_dtype, True
        existing.grad_in_forward = grad_in_forward
        return
    if is_fused_head_forward(model.__dict__.get("forward")):
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward is already a fused LM head (installed by a TRL trainer, or by "
            "add_fused_lm_head): memgrad's head cannot be put under it. Call memgrad_hf.patch_model(model) before "
            "building the TRL trainer (or memgrad_hf.grpo.patch_trl() before it), as in the recipes."
        )
    validate(model)
    had = "forward" in model.__dict__
    original = model.forward
    sig = inspect.signature(type(model).forward)
    sig = sig.replace(parameters=list(sig.parameters.values())[1:])  # drop self
    setattr(model, _ATTR, HeadPatch(chunk_size, accum_dtype, original, had, sig, grad_in_forward=grad_in_forward))
    # A method bound to the model (not a closure) so that copy.deepcopy(model) rebinds it to the copy
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _patched_forward(self, *args, **kwargs)

    present_as_forward(forward, model)
    forward._memgrad_head = True  # type: ignore[attr-defined]
    model.forward = types.MethodType(forward, model)


def is_fused_head_forward(fwd: Any) -> bool:
    """Whether ``fwd`` (an instance ``forward``) is a fused LM head, TRL's ``add_fused_lm_head`` or memgrad's: both
    take the ``fused_lm_head`` keyword of TRL's call contract (and both carry the class forward's name)."""
    code = getattr(getattr(fwd, "__func__", fwd), "__code__", None)
    return code is not None and "fused_lm_head" in code.co_varnames


def unpatch_head(model: nn.Module) -> bool:
    """Undo :func:`patch_head`: the model's own ``forward`` is back. Returns whether ``model`` was patched.

    Example::

        if unpatch_head(model): print("plain HF forward again")
    """
    patch: HeadPatch | None = getattr(model, _ATTR, None)
    if patch is None:
        return False
    current = model.__dict__.get("forward")
    if _forward_lost(model):  # unpickled: the class's forward is back already
        if not patch.had_instance_forward:
            del model.forward
        delattr(model, _ATTR)
        return True
    if not getattr(getattr(current, "__func__", None), "_memgrad_head", False):
        # Installed later on top of memgrad's forward (a TRL trainer's fused head, Liger's forward): removing memgrad's
        # would discard it, so memgrad's layer stays and passes every call through unchanged.
        patch.active = False
        by = getattr(current, "__module__", None) or type(current).__name__
        hint = ("a FORGE optimizer's exact-clipping wrapper: opt.detach() before unpatch_model restores the model "
                "exactly" if by == "memgrad_hf.optim.forge" else "another library's hook, e.g. accelerate's device "
                "dispatch or autocast, or TRL's fused head")
        logger.warning(
            "memgrad_hf: removing the chunked head: %s.forward was wrapped after patch_model (by %s: %s); memgrad's "
            "layer now passes every call through to the original forward, and the later wrapper is kept.",
            type(model).__name__, by, hint)
        return True
    if patch.had_instance_forward:
        model.forward = patch.original
    else:
        del model.forward
    delattr(model, _ATTR)
    return True


def set_head_weight_consumer(model: nn.Module, factory: Any) -> bool:
    """Let an optimizer receive the head's weight gradient in vocabulary blocks during backward
    (``factory(weight) -> consumer | None``); ``None`` restores normal gradients. Returns whether ``model`` is
    head-patched."""
    patch: HeadPatch | None = getattr(model, _ATTR, None)
    if patch is None:
        return False
    patch.weight_consumer_factory = factory
    return True


def head_patch(model: nn.Module) -> HeadPatch | None:
    """The chunked-head settings of a ``patch_model``ed ``model`` (None if it is not, or no longer, patched)."""
    patch: HeadPatch | None = getattr(model, _ATTR, None)
    if patch is None or not patch.active:
        return None
    if _forward_lost(model):
        if not patch.lost_warned:
            patch.lost_warned = True
            logger.warning("%s has its class's forward back although it was patched: it was pickled and loaded "
                           "again (torch.save(model), multiprocessing: pickling keeps the weights but not memgrad's "
                           "forward), or a hook put its saved forward back (accelerate's remove_hook_from_module "
                           "after dispatch_model). It computes full logits now. Call memgrad_hf.patch_model(model) "
                           "again (after loading, or after removing the hooks; or save with save_pretrained).",
                           type(model).__name__)
        return None
    return patch


def _forward_lost(model: nn.Module) -> bool:
    """The model's forward is its class's own again although it was patched: pickling stores a bound method by name,
    so an unpickled model gets the class's ``forward`` back while keeping the patch's bookkeeping (and accelerate's
    ``remove_hook_from_module`` puts back the forward it saved under its hook: the class's, where it hooked first)."""
    return getattr(model.__dict__.get("forward"), "__func__", None) is type(model).forward


def is_head_patched(model: nn.Module) -> bool:
    """Whether ``model`` runs the chunked head (:func:`patch_head` and not undone). Example: ``assert
    is_head_patched(memgrad_hf.patch_model(model))``."""
    return head_patch(model) is not None


@contextmanager
def head_label_smoothing(model: nn.Module, epsilon: float):
    """Within the block, the patched ``model``'s chunked loss is cross-entropy with label smoothing ``epsilon``
    (``F.cross_entropy``'s definition, which is also HF's ``LabelSmoother``'s)."""
    patch: HeadPatch = getattr(model, _ATTR)
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1); got {epsilon}.")
    previous, patch.label_smoothing = patch.label_smoothing, float(epsilon)
    try:
        yield
    finally:
        patch.label_smoothing = previous
