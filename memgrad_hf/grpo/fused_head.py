"""A drop-in for TRL's ``add_fused_lm_head``, computed by memgrad's chunked kernels.

Same arguments, the same ``model(..., labels=..., fused_lm_head=True)`` call contract and the same
``FusedCausalLMOutput`` fields as ``trl.trainer.utils.add_fused_lm_head`` (TRL >= 1.15); the per-token log-probs
and entropies come from :func:`memgrad_hf.functional.linear_logprobs`, which never holds more than one chunk of
logits on any device (TRL's CPU fallback builds several full ``[tokens x vocab]`` temporaries).
"""

from __future__ import annotations

import logging
import sys
import types
from contextlib import nullcontext
from typing import Any

import torch

from memgrad_hf.errors import UnsupportedModelError
from memgrad_hf.functional import linear_logprobs
from memgrad_hf.patches.head import capture_head_input, head_operands, head_patch, head_weight_consumer
from memgrad_hf.patches.probe import LogitsProbe
from memgrad_hf.patches.unwrap import base_model, present_as_forward

logger = logging.getLogger(__name__)

SUPPORTED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def add_fused_lm_head(
    model: Any,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
) -> None:
    """Make ``model(..., labels=labels, fused_lm_head=True)`` return per-token log-probs (and entropies) without the
    ``[batch, seq, vocab]`` logits, exactly as TRL's function of the same name does. Without ``fused_lm_head`` the
    original forward runs (generation unchanged).

    Example::

        from memgrad_hf.grpo import add_fused_lm_head

        add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
        out = model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True)
        out.log_probs, out.entropy, out.label_mask
    """
    try:
        from trl.trainer.utils import FusedCausalLMOutput
    except ImportError as e:
        raise ImportError(
            "memgrad_hf.grpo.add_fused_lm_head follows the fused-head contract of TRL >= 1.15 "
            "(trl.trainer.utils.FusedCausalLMOutput); upgrade TRL: pip install -U 'trl>=1.15'."
        ) from e
    unknown = [o for o in outputs if o not in SUPPORTED_OUTPUTS]
    if unknown:
        raise ValueError(f"outputs {unknown} are not computed by memgrad's fused head; supported: {SUPPORTED_OUTPUTS}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}.")
    original_forward = model.forward
    # a method bound to this model is called on the model it runs on: a deep copy (a reference or EMA model made
    # after the head was installed) then runs its own forward, not this one's
    own = getattr(original_forward, "__func__", None) if getattr(original_forward, "__self__", None) is model else None

    def run_original(self: Any, *args: Any, **kwargs: Any) -> Any:
        return own(self, *args, **kwargs) if own is not None else original_forward(*args, **kwargs)

    text_config = model.config.get_text_config()
    want_entropy = "entropy" in outputs
    want_diag = [o for o in ("log_sum_sq_probs", "mean_logits", "is_top1") if o in outputs]

    def forward(self: Any, *args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
                num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            kwargs.update({k: v for k, v in extra.items() if v is not None})
            return run_original(self, *args, **kwargs)
        if labels is None and shift_labels is None:
            raise ValueError("fused_lm_head=True scores the tokens given as labels: pass labels (unshifted, [batch, "
                             "seq], -100 where not scored) or shift_labels.")
        if labels is not None and labels.dim() != 2:
            raise ValueError(f"fused_lm_head=True: labels must be [batch, seq] like input_ids; got shape "
                             f"{tuple(labels.shape)}.")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if (labels is not None and isinstance(ids, torch.Tensor) and labels.shape[-1] == ids.shape[-1]
                and kwargs.get("logits_to_keep") is not None):
            kwargs.pop("logits_to_keep")  # as TRL's head: every position scored, the labels' -100 choose which
        kwargs["use_cache"] = False
        kwargs["return_dict"] = True  # (the output is a FusedCausalLMOutput either way)
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        # The model's own forward, with its head answering a probe: the hidden states the head really receives (after
        # any head transform, inside any wrapper) and every rewrite the forward applies to the logits (softcap,
        # scales) are observed, not looked up per family; ops the chunked kernels cannot reproduce are refused.
        with capture_head_input(self) as cap:
            body = run_original(self, *args, **kwargs)
        probe = body.get("logits") if hasattr(body, "get") else None
        if cap.head_calls != 1 or not isinstance(probe, LogitsProbe):
            raise UnsupportedModelError(
                f"{cap.owner}.forward did not return its LM head's output as logits; memgrad_hf's fused head needs "
                "the standard causal-LM forward. Use TRL's own fused head for this model."
            )
        hidden = probe._chain.rows(cap.hidden)  # the positions of the returned logits (prophetnet: its first stream)
        if shift_labels is None:
            if labels.shape[-1] != hidden.shape[1]:
                raise ValueError(
                    f"fused_lm_head=True: labels cover {labels.shape[-1]} positions and the model returned "
                    f"{hidden.shape[1]}: pass the unshifted labels, as long as input_ids (the model shifts them; "
                    "-100 where not scored), or the already shifted ones as shift_labels= (as long as input_ids: "
                    "labels[..., 1:] with -100 appended)."
                )
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            if shift_labels.shape[-1] != hidden.shape[1]:
                raise ValueError(
                    f"fused_lm_head=True: shift_labels cover {shift_labels.shape[-1]} positions and the model returned "
                    f"{hidden.shape[1]}: shift_labels are as long as input_ids (labels[..., 1:] with -100 appended, as "
                    "transformers builds them)."
                )
            targets = shift_labels
        head = self.get_output_embeddings()
        weight_device = next(head.parameters()).device
        hidden, targets = hidden.to(weight_device), targets.to(weight_device)
        mask = targets != -100
        diag: dict | None = {} if want_diag else None
        res = _fused_log_probs(self, head, cap, probe._chain, hidden, targets, temperature=temperature,
                               cast_lm_head_to_fp32=cast_lm_head_to_fp32, want_entropy=want_entropy, diagnostics=diag)
        log_probs, entropy = res if want_entropy else (res, None)
        extra = {k: (diag[k] if k in want_diag else None) for k in ("log_sum_sq_probs", "mean_logits", "is_top1")}
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / denom
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            aux_loss = load_balancing_loss_func(body.router_logits, text_config.num_experts,
                                                text_config.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss,
                                   **extra)

    present_as_forward(forward, model)
    model.forward = types.MethodType(forward, model)


# opaque to torch.compile as a whole, as the patched model's chunked loss is: the FORGE consumer of the head weight's
# gradient it builds is Python bookkeeping (sets of parameters) that dynamo would otherwise trace into
@torch.compiler.disable
def _fused_log_probs(model: Any, head: torch.nn.Module, cap: Any, chain: Any, hidden: torch.Tensor,
                     targets: torch.Tensor, *, temperature: float, cast_lm_head_to_fp32: bool, want_entropy: bool,
                     diagnostics: dict | None) -> Any:
    """:func:`linear_logprobs` of the head's operands (``head_operands``: its weight, bias and logit rewrites)."""
    hidden, weight, bias, softcap, scale = head_operands(head, hidden, cap.owner, chain, cap.linear)
    # a patch_model()ed model: its chunk size and accumulator dtype, and a FORGE optimizer's block-wise update of
    # the head weight (its gradient never exists), as in the patched model's own loss. Taken before the fp32 cast:
    # the blocks of the copy's gradient are the weight's, in fp32 (autograd would round them to the weight dtype)
    patch = head_patch(model)
    settings = {} if patch is None else dict(chunk_size=patch.chunk_size, accum_dtype=patch.accum_dtype,
                                              weight_grad_consumer=head_weight_consumer(patch, head, weight, bias))
    ctx = nullcontext()
    if cast_lm_head_to_fp32:
        hidden, weight = hidden.float(), weight.float()
        bias = None if bias is None else bias.float()
        ctx = torch.autocast(hidden.device.type, enabled=False)
    with ctx:
        return linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, softcap=softcap,
                               logit_scale=scale, return_entropy=want_entropy, ignore_index=-100,
                               diagnostics=diagnostics, **settings)


_TRL_MODULES = ("grpo_trainer", "rloo_trainer", "kto_trainer", "sft_trainer", "dpo_trainer")  # imported by patch_trl
_ORIGINALS: dict[str, Any] = {}  # module name -> TRL's add_fused_lm_head it held
_ALL_MODELS = {"on": False}


def is_memgrad_patched(model: Any) -> bool:
    """Whether ``model`` (or the causal LM under its PEFT wrapper) went through ``patch_model`` with the head."""
    from memgrad_hf.patches.head import is_head_patched

    return is_head_patched(base_model(model)) or is_head_patched(model)


def _trainer_policy(caller: Any) -> torch.nn.Module | None:
    """The causal LM that the trainer whose ``__init__`` is ``caller`` (a frame) trains, or None."""
    trainer = caller.f_locals.get("self") if caller is not None else None
    policy = getattr(trainer, "model", None)
    return base_model(policy) if isinstance(policy, torch.nn.Module) else None


def _mirror_titans(policy: torch.nn.Module, model: torch.nn.Module) -> None:
    """TRL builds a reference model from the policy's path with a plain ``from_pretrained``, which drops a Titans
    memory (its keys are "unexpected"): the reference gets the policy's memory branches, with the policy's weights
    (at trainer creation, before any update), so that it scores what the policy started as."""
    from memgrad_hf.patches.titans import CONFIG_ATTR, inject_titans, is_titans_patched
    from memgrad_hf.titans import titans_state_dict

    if model is policy or not is_titans_patched(policy) or is_titans_patched(model):
        return
    trainable = any(p.requires_grad for p in model.parameters())
    inject_titans(model, getattr(policy.config, CONFIG_ATTR))
    memory = titans_state_dict(policy)
    unexpected = model.load_state_dict(memory, strict=False).unexpected_keys
    if unexpected:
        raise UnsupportedModelError(
            f"the reference model ({type(model).__name__}) does not take the policy's Titans memory "
            f"({unexpected[:3]}...): pass a reference with the same architecture, loaded with "
            "memgrad_hf.titans.from_pretrained."
        )
    for name, p in model.named_parameters():
        if name in memory:
            p.requires_grad_(trainable)
    logger.warning("memgrad_hf: the reference model %s had no Titans memory (TRL loads it from the path without it): "
                   "it now has the policy's, as the policy was when the trainer was built.", type(model).__name__)


def _dispatch(model: Any, *args: Any, **kwargs: Any) -> Any:
    """What TRL's trainers call: memgrad's head for every model after ``patch_trl()``, else for ``patch_model``ed
    models and the other models of a trainer whose policy is one; TRL's own otherwise. TRL installs the head on the
    policy, then on ``self.ref_model``: the reference of a patched policy gets memgrad's head too, so both score with
    the same kernels (log-ratios exactly 0 while the weights are equal, as with TRL's head on both). The reference
    of a policy with Titans memory gets that memory (with or without the chunked head)."""
    policy = _trainer_policy(sys._getframe(1))
    if policy is not None:
        _mirror_titans(policy, model)
    of_patched_policy = policy is not None and is_memgrad_patched(policy) and not is_memgrad_patched(model)
    if _ALL_MODELS["on"] or is_memgrad_patched(model) or of_patched_policy:
        return add_fused_lm_head(model, *args, **kwargs)
    return _trl_original()(model, *args, **kwargs)


def _trl_original() -> Any:
    from trl.trainer import utils

    return _ORIGINALS.get("trl.trainer.utils", utils.add_fused_lm_head)


def _install(modules: Any = None) -> list[str]:
    """Point every loaded ``trl`` module's ``add_fused_lm_head`` (TRL's trainers import it by name, experimental
    ones included) and ``trl.trainer.utils``' own (for trainers imported later) to :func:`_dispatch`; with
    ``modules != "loaded"`` the stable trainers are imported first. Returns the trainer modules routed."""
    import importlib

    try:
        original = _trl_original()
    except (ImportError, AttributeError):  # no TRL, or one without a fused head (< 1.15)
        return []
    if modules != "loaded":
        for name in _TRL_MODULES:
            try:
                importlib.import_module(f"trl.trainer.{name}")
            except Exception:  # a trainer TRL does not ship (or that fails to import) is simply not patched
                continue
    done = []
    for full, mod in list(sys.modules.items()):
        if mod is None or not (full == "trl" or full.startswith("trl.")):
            continue
        current = vars(mod).get("add_fused_lm_head")  # vars(): no lazy-module import triggered
        if current is original:
            _ORIGINALS[full] = current
            mod.add_fused_lm_head = _dispatch
        if current in (original, _dispatch) and full != "trl.trainer.utils":
            done.append(full.rsplit(".", 1)[-1])
    return sorted(done)


def patch_trl() -> list[str]:
    """Make TRL's trainers install memgrad's fused head instead of their own for every model (training,
    old-policy and reference passes all go through it). Idempotent; returns the patched module names. Undo with
    :func:`unpatch_trl`. Without this call, a model passed through :func:`memgrad_hf.patch_model` gets memgrad's head
    automatically in every TRL trainer built around it, and so does that trainer's reference model.

    Example::

        import memgrad_hf.grpo

        memgrad_hf.grpo.patch_trl()
        trainer = GRPOTrainer(model=model, args=GRPOConfig(...), reward_funcs=..., train_dataset=...)
    """
    done = _install()
    if not done:
        raise ImportError("this TRL has no fused LM head (TRL >= 1.15 needed for memgrad_hf.grpo.patch_trl).")
    _ALL_MODELS["on"] = True
    return done


def route_patched_models() -> list[str]:
    """Called when a TRL trainer is built around a ``patch_model``ed model (``memgrad_hf.patches.trainer``): the TRL
    trainer modules imported by then send that model (and its trainer's reference model) to memgrad's head; other
    models keep TRL's."""
    return _install("loaded")


def unpatch_trl() -> None:
    """Restore TRL's own fused head in every module memgrad changed."""
    import importlib

    _ALL_MODELS["on"] = False
    if not _ORIGINALS:
        return
    original = _trl_original()
    for name in list(_ORIGINALS):
        importlib.import_module(name).add_fused_lm_head = _ORIGINALS.pop(name)
    for full, mod in list(sys.modules.items()):  # trainers imported while patched took the dispatcher
        if mod is not None and full.startswith("trl.") and vars(mod).get("add_fused_lm_head") is _dispatch:
            mod.add_fused_lm_head = original
