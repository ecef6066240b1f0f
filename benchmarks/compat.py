"""Which transformers causal-LM families memgrad serves exactly (``memgrad-hf bench compat``).

For every model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny config is derived from the family's default
config (size fields shrunk, a few layers kept such that every layer kind of a hybrid model is present, per-layer
fields resized with them; ``FAMILY`` overrides where no generic rule can work), the model is built twice from one
seed, one copy is patched, and the loss and every parameter gradient of a training forward with ``-100`` labels are
compared (1e-5 relative, fp32). ``--logprobs`` checks TRL's fused-head contract instead, ``--titans`` the Titans
injection (``benchmarks.compat_titans``), ``--forge`` FORGE's steps against torch's AdamW (``benchmarks.compat_forge``).

Statuses: ``exact``; ``unsupported`` (memgrad raised ``UnsupportedModelError``: the message says why);
``MISMATCH`` / ``ERROR`` (a memgrad bug: please report); ``untested`` (the shrunk config could not be built or the
*unpatched* model failed on it — says nothing about memgrad).
"""

from __future__ import annotations

import argparse
import copy
import re
import signal
import sys
import warnings
from collections import Counter
from typing import Any

import torch

# Size fields, set wherever a family's config has them (never raised: a family with fewer heads keeps them; a
# None is set too, e.g. deepseek_v2's num_experts_per_tok, except in KEEP_NONE where None switches a part off).
SHRINK: dict[str, int] = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=101, head_dim=8,
    n_embd=32, embedding_dim=32, emb_dim=32, n_head=4, d_model=32, ffn_dim=64, n_inner=64, max_position_embeddings=64,
    n_positions=64,
    # bart-style encoder-decoder fields (the decoder is the causal LM)
    decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64,
    # mixture of experts
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, num_experts_per_token=2, n_group=1,
    num_expert_group=1, topk_group=1,
    # multi-head latent attention (its head dims: MLA_DIMS)
    kv_lora_rank=16, q_lora_rank=16,
    # per-layer inputs (gemma3n / gemma4)
    vocab_size_per_layer_input=101, hidden_size_per_layer_input=8,
    # linear-attention (gated delta net / KDA) heads
    linear_num_heads=4, linear_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8,
    # rotary dims of gptj / codegen style configs (at most the head dim)
    rotary_dim=4,
    # mamba / state-space blocks: heads x head dim == expand x hidden_size
    mamba_n_heads=8, mamba_d_head=8, mamba_d_ssm=64, mamba_d_state=8, mamba_chunk_size=8, mamba_dt_rank=8, num_heads=8,
    state_size=8, n_groups=1, mamba_n_groups=1, time_step_rank=8, chunk_size=8,
)
# MLA head dims are all divided by one factor (qk_rope_head_dim -> MLA_ROPE_DIM), so that relations such as
# head_dim == qk_nope_head_dim + qk_rope_head_dim (dots3_note's sliding layers) stay true.
MLA_ROPE_DIM = 8
MLA_DIMS = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim", "head_dim", "index_head_dim")
KEEP_NONE = {"q_lora_rank"}  # MLA without a low-rank query projection
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0)
LAYER_COUNTS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_blocks", "decoder_layers", "encoder_layers",
)
MIN_LAYERS, MAX_LAYERS = 2, 4
# Counts of the first / last layers that differ (dense MLPs before the MoE ones, KV-sharing layers), recounted over
# the kept layers; the leading ones are a layer kind to keep (a dense and a MoE layer).
LEADING, TRAILING = ("first_k_dense_replace", "num_dense_layers"), ("num_kv_shared_layers",)
# Only where no generic rule can work (applied to the text config; "<family>_text" uses the entry of <family>).
FAMILY: dict[str, dict[str, object]] = {
    # defaults without any attention layer (the unpatched model then fails in a training forward) or without layer
    # types at all
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # layer patterns given as (pattern, repeats) or as a cycle
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    # defaults the model itself cannot be built or trained from: no rope parameters for its layer type; attention
    # reading attn_config.rope_theta and clamping to clip_qkv; indexed attention enabled without an indexer
    "cohere_compass": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "dbrx": dict(attn_config=dict(kv_n_heads=1, rope_theta=10_000.0, clip_qkv=8.0),
                 ffn_config=dict(hidden_size=32, ffn_hidden_size=64)),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
                      indexer_compress_ratio=4),
    # a looped (recurrent-depth) decoder: its to_dict() interleaves an "mlp" entry after every layer type and doubles
    # the section counts, which the generic layer rules cannot keep consistent; input, looped and output sections
    "dory": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    # trains on sequences of exactly prod(axial_pos_shape) tokens (check() uses 8); its reversible layers reseed
    # torch from entropy (torch.seed()), so hashing and dropout must not draw random numbers
    "reformer": dict(is_decoder=True, axial_pos_shape=[2, 4], axial_pos_embds_dim=[16, 16], local_attn_chunk_length=4,
                     lsh_attn_chunk_length=4, hash_seed=0, hidden_dropout_prob=0.0,
                     local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0),
    # its cache rounds the q/k and v widths up to multiples of 64; the cache breaks the training backward
    "xlstm": dict(hidden_size=128, embedding_dim=128, use_cache=False),
    "xmod": dict(default_language="en_XX"),  # adapters need a language
    # the shared block is tied across hybrid layers: needs two of them
    "zamba": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]),
}


# --task: the auto class a sweep builds, and the transformers mapping that lists its model types
TASKS: dict[str, tuple[str, str]] = {
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "seq-cls": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
}


def _batch(task: str, vocab: int) -> dict[str, torch.Tensor]:
    """A fixed training batch for ``task``: 2 x 8 token ids and the task's labels (token labels with ``-100`` at the
    start of the first row; a seq2seq model's own 8 target tokens; a classifier's two classes, rows ending in eos).
    The seq2seq mapping also lists decoder-only speech LMs, whose labels must be as long as their inputs: hence 8
    targets."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 101), (2, 8), generator=gen)
    if task == "seq-cls":  # ends in eos: the encoder-decoders' classifiers read its position
        ids[:, -1] = TOKEN_IDS["eos_token_id"]
        return dict(input_ids=ids, labels=torch.tensor([0, 1]))
    labels = torch.randint(3, min(vocab, 101), (2, 8), generator=gen) if task == "seq2seq" else ids.clone()
    labels[0, :2] = -100
    return dict(input_ids=ids, labels=labels)


class _Timeout(BaseException):  # not caught by check()'s `except Exception`
    pass


def _brief(text: str, n: int = 110) -> str:
    """``text`` on one line in at most ``n`` characters, cut after a sentence (or clause) where one ends in its
    second half, else at a word, marked with an ellipsis: a table cell, not a sentence broken off mid-word."""
    text = " ".join(str(text).split())
    if len(text) <= n:
        return text
    head = text[:n - 1]
    end = max(head.rfind(". "), head.rfind("; "), head.rfind(": "))
    if end >= n // 2:
        return head[:end + 1] + " …"
    return head[:head.rfind(" ")].rstrip(",;:") + " …" if " " in head else head + "…"


def _why(e: Exception, n: int) -> str:
    """One line: the exception (a config validator's cause rather than its wrapper), cut to ``n`` characters."""
    if e.__cause__ is not None and "Validation" in type(e).__name__:
        e = e.__cause__  # type: ignore[assignment]
    return _brief(f"{type(e).__name__}: {e}", n)


def _is_index_list(name: str, value: object, n_layers: int) -> bool:
    """A list of layer indices (``moe_layers``, ``hybrid_layer_ids``, ``mlp_only_layers`` ...)."""
    return (
        isinstance(value, list) and re.search(r"layer|idx|ids|ind", name) is not None
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        and value == sorted(set(value)) and all(0 <= i < n_layers for i in value)
    )


def _keep_layers(d: dict[str, Any], n_layers: int) -> list[int]:
    """Which of the ``n_layers`` original layers a tiny model keeps: greedily, layers showing a kind (a value of a
    per-layer list such as ``layer_types``, membership in an index list, a ``per_layer_config`` override) not yet
    kept, so that e.g. a hybrid model keeps one full-attention layer; at least ``MIN_LAYERS``."""
    kinds: list[set[tuple[str, object]]] = [set() for _ in range(n_layers)]
    for k, v in d.items():
        if _is_index_list(k, v, n_layers):
            for i in range(n_layers):
                kinds[i].add((k, i in v))
        elif isinstance(v, list) and len(v) == n_layers:
            for i, x in enumerate(v):
                kinds[i].add((k, repr(x)))
    for key, over in (d.get("per_layer_config") or {}).items():
        kinds[int(key)].add(("per_layer_config", repr(sorted(over.items()))))
    for k in LEADING:
        if isinstance(d.get(k), int):
            for i in range(n_layers):
                kinds[i].add((k, i < d[k]))
    kept: list[int] = []
    missing = set().union(*kinds)
    while missing and len(kept) < MAX_LAYERS:
        best = max(range(n_layers), key=lambda i: (len(kinds[i] & missing), -i))
        kept.append(best)
        missing -= kinds[best]
    kept += [i for i in range(n_layers) if i not in kept][: max(0, MIN_LAYERS - len(kept))]
    return sorted(kept)


def _scaled(name: str, value: object, old: dict[str, Any], new: dict[str, Any]) -> object:
    """A per-layer size keeps its ratio to the global value (e.g. gemma4's doubled ``head_dim`` on full attention)."""
    key = name.removesuffix("_per_layer")
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    before, after = old.get(key), new.get(key, old.get(key))
    if isinstance(before, int) and isinstance(after, int) and before:
        return max(1, round(value * after / before))
    return min(value, SHRINK[key]) if key in SHRINK else value


def _shrunk(d: dict[str, Any]) -> dict[str, Any]:
    """The changes that make one config (as ``to_dict()``) tiny: sizes, layer count and every per-layer field."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if k in SHRINK and isinstance(v, int) and not isinstance(v, bool):
            out[k] = min(v, SHRINK[k])
        elif k in SHRINK and v is None and k not in KEEP_NONE:
            out[k] = SHRINK[k]
        elif k in TOKEN_IDS:
            out[k] = TOKEN_IDS[k]
        elif re.fullmatch(r"\w+_layer_period", k) and isinstance(v, int):  # jamba / zamba: attention, experts
            # every other layer, from layer 1
            out[k] = 2
        elif re.fullmatch(r"\w+_layer_offset", k) and isinstance(v, int):
            out[k] = 1
    if isinstance(d.get("qk_rope_head_dim"), int):
        factor = max(1, d["qk_rope_head_dim"] // MLA_ROPE_DIM)
        out.update({k: max(1, d[k] // factor) for k in MLA_DIMS if isinstance(d.get(k), int)})
    if d.get("num_key_value_heads") == d.get("num_attention_heads") and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # multi-head attention (e.g. MLA) stays so
    n_layers = next((d[k] for k in LAYER_COUNTS if isinstance(d.get(k), int)), None)
    if n_layers is None:
        return out
    kept = _keep_layers(d, n_layers)
    new_index = {old: new for new, old in enumerate(kept)}
    for k in LAYER_COUNTS:
        if isinstance(d.get(k), int):
            out[k] = len(kept)
    for k, v in d.items():
        if _is_index_list(k, v, n_layers):
            out[k] = [new_index[i] for i in v if i in new_index]
        elif isinstance(v, list) and len(v) == n_layers:
            out[k] = [_scaled(k, v[i], d, out) for i in kept]
    for k in LEADING:
        if isinstance(d.get(k), int):
            out[k] = sum(i < d[k] for i in kept)
    for k in TRAILING:
        if isinstance(d.get(k), int):
            out[k] = sum(i >= n_layers - d[k] for i in kept)
    if d.get("per_layer_config"):
        out["per_layer_config"] = {
            new_index[int(i)]: {a: _scaled(a, x, d, out) for a, x in over.items()}
            for i, over in d["per_layer_config"].items() if int(i) in new_index
        }
    return out


def _tiny(family: str, task: str = "causal-lm") -> torch.nn.Module:
    """The family's default config made tiny (its text config, for a multimodal one), as a model in fp32, built by
    ``task``'s auto class (:data:`TASKS`)."""
    import transformers
    from transformers import AutoConfig

    base = AutoConfig.for_model(family)
    text = base.get_text_config(decoder=True)
    text_changes = {**_shrunk(text.to_dict()), **FAMILY.get(family.removesuffix("_text"), {})}
    changes = text_changes if text is base else _shrunk(base.to_dict())
    for name in getattr(base, "sub_configs", {}) if text is not base else ():
        sub = getattr(base, name, None)
        if sub is text:
            changes[name] = {**text.to_dict(), **text_changes}
        elif hasattr(sub, "to_dict") and task != "causal-lm":  # built too (a speech LM's audio encoder): shrunk
            changes[name] = {**sub.to_dict(), **_shrunk(sub.to_dict())}
        elif hasattr(sub, "to_dict"):  # outputs projected into the text model follow its width (dots3_note)
            width = text.to_dict().get("hidden_size")
            new_width = text_changes.get("hidden_size", width)
            follow = {k: new_width for k, v in sub.to_dict().items() if "out" in k and v == width}
            if follow:
                changes[name] = {**sub.to_dict(), **follow}
    if task != "causal-lm":  # t5-style configs have no such field to shrink; their decoders need one
        changes.setdefault("decoder_start_token_id", TOKEN_IDS["decoder_start_token_id"])
    cfg = AutoConfig.for_model(family, **changes)
    torch.manual_seed(0)
    return getattr(transformers, TASKS[task][0]).from_config(cfg).float().train()


def _tiny_vision(family: str) -> torch.nn.Module:
    """An image-text-to-text model with every sub-config (text, vision, ...) shrunk by the same rules, in fp32."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    base = AutoConfig.for_model(family)
    changes: dict[str, Any] = {}
    for name in getattr(base, "sub_configs", {}):
        sub = getattr(base, name, None)
        if hasattr(sub, "to_dict"):
            changes[name] = {**sub.to_dict(), **_shrunk(sub.to_dict())}
    for name, override in VISION_FAMILY.get(family, {}).items():
        changes[name] = {**changes.get(name, {}), **override}
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(AutoConfig.for_model(family, **changes)).float().train()


# multimodal rotary sections must sum to the (shrunk) head_dim / 2
_MROPE = {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "mrope_section": [1, 1, 2]}}
_QWEN_VIT = {"depth": 1, "num_heads": 4, "hidden_size": 32, "embed_dim": 32, "intermediate_size": 64,
             "out_hidden_size": 32}
VISION_FAMILY: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"text_config": _MROPE, "vision_config": _QWEN_VIT},
    "qwen2_5_vl": {"text_config": _MROPE, "vision_config": _QWEN_VIT},
}


def check(family: str, vision: bool = False, logprobs: bool = False, task: str = "causal-lm",
          bf16: bool = False) -> tuple[str, str]:
    """Text-only training forward of the tiny model, patched vs unpatched (``vision``: an image-text-to-text
    model type; ``task``: the model class, :data:`TASKS`). ``logprobs``: TRL's fused-head contract instead
    (:func:`memgrad_hf.grpo.add_fused_lm_head`): per-token log-probs and every gradient of their sum against
    ``log_softmax`` of the model's own logits. ``bf16``: both models in bf16; "close" then means the loss in stock's
    dtype and within 2% of it (stock's own bf16 log-softmax is that far off), and the gradients, all parameters
    together, at cosine similarity >= 0.999."""
    import memgrad_hf

    try:
        model = _tiny_vision(family) if vision else _tiny(family, task)
        if bf16:
            model = model.to(torch.bfloat16)
    except Exception as e:
        return "untested", f"tiny config: {_why(e, 90)}"
    try:
        ref = copy.deepcopy(model)
        # a fresh copy for the log-probs reference: some models change state on their first call (big_bird
        # switches its attention type), so the reference must be a first call as well
        lp_ref = copy.deepcopy(model) if logprobs else None
    except Exception as e:
        return "untested", f"cannot copy the model: {_why(e, 80)}"
    head = model.get_output_embeddings()
    batch = _batch(task, head.weight.shape[0] if head is not None else 101)
    ids, labels = batch["input_ids"], batch["labels"]
    try:
        torch.manual_seed(1)
        r = ref(**batch)
        r.loss.backward()
        if logprobs:  # the reference is log_softmax of the unpatched model's logits, not its loss
            ref = lp_ref
            mask = labels[:, 1:] != -100
            torch.manual_seed(1)
            logits = ref(input_ids=ids).logits[:, :-1].float()
            ref_lp = logits.log_softmax(-1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0] * mask
            ref_lp.sum().backward()
    except Exception as e:
        return "untested", f"unpatched model fails on the tiny config: {_why(e, 80)}"
    try:
        if logprobs:
            from memgrad_hf.grpo import add_fused_lm_head

            add_fused_lm_head(model, outputs=("log_probs",))
            torch.manual_seed(1)
            lp = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs * mask
            lp.sum().backward()
        else:
            memgrad_hf.patch_model(model, chunk_size=4)
            torch.manual_seed(1)
            o = model(**batch)
            o.loss.backward()
    except memgrad_hf.UnsupportedModelError as e:
        return "unsupported", _brief(str(e))
    except Exception as e:
        return "ERROR", _brief(f"{type(e).__name__}: {e}")
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True) if q.grad is not None]
    if bf16 and not logprobs:
        if any(p is None for p, _ in pairs):
            return "MISMATCH", "a parameter got no gradient"
        cos = _grad_cosine(*zip(*pairs, strict=True))
        rel = abs(o.loss.float().item() - r.loss.float().item()) / abs(r.loss.float().item())
        ok = o.loss.dtype == r.loss.dtype and rel <= 2e-2 and cos >= 0.999
        return ("close" if ok else "MISMATCH"), (f"{type(model).__name__} (loss {o.loss.dtype} vs stock's "
                                                 f"{r.loss.dtype}, {rel:.0e} apart; gradient cosine {cos:.5f})")
    scale = max(q.abs().max().item() for _, q in pairs)
    if logprobs:
        same_loss = (lp.detach() - ref_lp.detach()).abs().max().item() <= 1e-5 * ref_lp.detach().abs().max().item()
    else:
        same_loss = abs(o.loss.item() - r.loss.item()) <= 1e-5 * abs(r.loss.item())
    same_grads = all(
        p is not None and (p - q).abs().max().item() <= 1e-5 * q.abs().max().item() + 1e-6 * scale for p, q in pairs
    )
    return ("exact" if same_loss and same_grads else "MISMATCH"), type(model).__name__


def _grad_cosine(grads: Any, ref_grads: Any) -> float:
    """Cosine similarity of two sets of gradients, each taken as one vector (the bf16 checks' criterion)."""
    a, b = (torch.cat([t.float().flatten() for t in ts]) for ts in (grads, ref_grads))
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def _enable_checkpointing(model: torch.nn.Module, reentrant: bool) -> None:
    """transformers' gradient checkpointing under this version's name (``activation_checkpointing_enable`` since
    5.24); raises ``ValueError`` where the model does not support it."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memgrad-hf bench compat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("families", nargs="*", help="model types (default: every causal-LM model type)")
    p.add_argument("--timeout", type=int, default=30, help="seconds per family")
    p.add_argument("--memory-gb", type=float, default=12.0,
                   help="address space the sweep may add to this process's (a family whose shrunk config is still "
                        "huge then fails with 'can't allocate', untested, instead of the whole sweep being killed by "
                        "the OOM killer); 0: no limit")
    p.add_argument("--vision", action="store_true",
                   help="image-text-to-text (vision-language) model types instead, text-only forward")
    p.add_argument("--logprobs", action="store_true",
                   help="check memgrad_hf.grpo.add_fused_lm_head (TRL's fused-head contract: per-token log-probs "
                        "and their gradients) instead of the patched training loss")
    p.add_argument("--forge", action="store_true",
                   help="check ForgeAdamW with exact clipping instead, against torch.optim.AdamW + clip_grad_norm_")
    p.add_argument("--checkpointing", action="store_true",
                   help="with --forge: under reentrant gradient checkpointing (both models)")
    p.add_argument("--lora", action="store_true",
                   help="with --forge: a PEFT LoRA adapter on every linear layer trains instead of the model")
    p.add_argument("--compile", action="store_true",
                   help="with --forge: FORGE's model under torch.compile (aot_eager backend), the reference eager")
    p.add_argument("--task", choices=sorted(TASKS), default="causal-lm",
                   help="the model class swept (default causal-lm): seq2seq (encoder-decoders), masked-lm, seq-cls "
                        "(sequence classification: --forge only, it has no LM head)")
    p.add_argument("--bf16", action="store_true",
                   help="the head check with both models in bf16 (close: the loss in stock's dtype, within 2%%; the "
                        "gradients at cosine >= 0.999); with --forge FORGE against torch's AdamW in bf16 (close: "
                        "updates within 10%%, every parameter moved); with --titans the injection into a bf16 model")
    p.add_argument("--titans", action="store_true",
                   help="check Titans injection instead: step-0 identity, memory gradients, cached == uncached")
    a = p.parse_args(argv)
    if a.bf16 and a.logprobs:
        p.error("--bf16 is for the head check, --forge and --titans: without --logprobs")
    if a.task != "causal-lm" and (a.vision or a.logprobs or a.titans or (a.task == "seq-cls" and not a.forge)):
        p.error(f"--task {a.task} is swept by the head check or --forge (--forge only for seq-cls), without --vision, "
                "--logprobs or --titans")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/statm") as f:  # pages of address space in use now
            used = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        used = None
    limit = int(a.memory_gb * 2**30) + (used or 0)
    if a.memory_gb > 0 and used is not None and (soft == resource.RLIM_INFINITY or soft > limit):
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        return _sweep(a)
    finally:  # (the CLI may run inside a longer-lived process: tests)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _sweep(a: argparse.Namespace) -> int:
    from transformers.models.auto import modeling_auto
    from transformers.utils import logging as hf_logging

    from benchmarks.compat_forge import check_forge
    from benchmarks.compat_titans import check_titans

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    mapping = "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES" if a.vision else TASKS[a.task][1]
    families = a.families or sorted(getattr(modeling_auto, mapping))

    def on_alarm(*_: object) -> None:
        raise _Timeout

    signal.signal(signal.SIGALRM, on_alarm)
    results = {}
    for fam in families:
        signal.alarm(a.timeout)
        try:
            if a.titans:
                status, detail = check_titans(fam, a.vision, a.bf16)
                # (in bf16 the step-0 identity is still bit for bit; the rest holds at bf16 tolerances)
                results[fam] = (status.replace("exact", "close") if a.bf16 else status), detail
            elif a.forge:
                results[fam] = check_forge(fam, a.vision, checkpointing=a.checkpointing, logprobs=a.logprobs,
                                           lora=a.lora, task=a.task, bf16=a.bf16, compile=a.compile)
            else:
                results[fam] = check(fam, a.vision, a.logprobs, a.task, a.bf16)
        except _Timeout:
            results[fam] = ("untested", f"over {a.timeout}s")
        finally:
            signal.alarm(0)
    print("| model type | status | detail |\n|---|---|---|")
    for fam, (status, detail) in results.items():
        print(f"| {fam} | {status} | {detail.replace('|', '/')} |")
    counts = Counter(s for s, _ in results.values())
    print("\n" + ", ".join(f"{k}: {v}" for k, v in counts.most_common()))
    return 1 if counts.get("MISMATCH") or counts.get("ERROR") else 0


if __name__ == "__main__":
    sys.exit(main())
