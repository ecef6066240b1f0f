"""Which transformers causal-LM families memgrad serves exactly (``memgrad-hf bench compat``).

For every model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny config is derived from the family's default
config (size fields shrunk, a few layers kept such that every layer kind of a hybrid model is present, per-layer
fields resized with them; ``FAMILY`` overrides where no generic rule can work), the model is built twice from one
seed, one copy is patched, and the loss and every parameter gradient of a training forward with ``-100`` labels are
compared (1e-5 relative, fp32). ``--logprobs`` checks TRL's fused-head contract instead, ``--titans`` the Titans
injection (:func:`check_titans`), ``--forge`` two ``ForgeAdamW`` steps with exact clipping (:func:`check_forge`).

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


class _Timeout(BaseException):  # not caught by check()'s `except Exception`
    pass


def _why(e: Exception, n: int) -> str:
    """One line: the exception (a config validator's cause rather than its wrapper), cut to ``n`` characters."""
    if e.__cause__ is not None and "Validation" in type(e).__name__:
        e = e.__cause__  # type: ignore[assignment]
    return " ".join(f"{type(e).__name__}: {e}".split())[:n]


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


def _tiny(family: str) -> torch.nn.Module:
    """The family's default config made tiny (its text config, for a multimodal one), as a model in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoConfig.for_model(family)
    text = base.get_text_config(decoder=True)
    text_changes = {**_shrunk(text.to_dict()), **FAMILY.get(family.removesuffix("_text"), {})}
    changes = text_changes if text is base else _shrunk(base.to_dict())
    for name in getattr(base, "sub_configs", {}) if text is not base else ():
        sub = getattr(base, name, None)
        if sub is text:
            changes[name] = {**text.to_dict(), **text_changes}
        elif hasattr(sub, "to_dict"):  # outputs projected into the text model follow its width (dots3_note)
            width = text.to_dict().get("hidden_size")
            new_width = text_changes.get("hidden_size", width)
            follow = {k: new_width for k, v in sub.to_dict().items() if "out" in k and v == width}
            if follow:
                changes[name] = {**sub.to_dict(), **follow}
    cfg = AutoConfig.for_model(family, **changes)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


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


def check(family: str, vision: bool = False, logprobs: bool = False) -> tuple[str, str]:
    """Text-only training forward of the tiny model, patched vs unpatched (``vision``: an image-text-to-text
    model type). ``logprobs``: TRL's fused-head contract instead (:func:`memgrad_hf.grpo.add_fused_lm_head`):
    per-token log-probs and every gradient of their sum against ``log_softmax`` of the model's own logits."""
    import memgrad_hf

    try:
        model = _tiny_vision(family) if vision else _tiny(family)
    except Exception as e:
        return "untested", f"tiny config: {_why(e, 90)}"
    ref = copy.deepcopy(model)
    # a fresh copy for the log-probs reference: some models change state on their first call (big_bird switches
    # its attention type), so the reference must be a first call as well
    lp_ref = copy.deepcopy(model) if logprobs else None
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else 101
    ids = torch.randint(3, min(vocab, 101), (2, 8))
    labels = ids.clone()
    labels[0, :2] = -100
    try:
        torch.manual_seed(1)
        r = ref(input_ids=ids, labels=labels)
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
            o = model(input_ids=ids, labels=labels)
            o.loss.backward()
    except memgrad_hf.UnsupportedModelError as e:
        return "unsupported", str(e)[:110]
    except Exception as e:
        return "ERROR", f"{type(e).__name__}: {str(e)[:100]}"
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True) if q.grad is not None]
    scale = max(q.abs().max().item() for _, q in pairs)
    if logprobs:
        same_loss = (lp.detach() - ref_lp.detach()).abs().max().item() <= 1e-5 * ref_lp.detach().abs().max().item()
    else:
        same_loss = abs(o.loss.item() - r.loss.item()) <= 1e-5 * abs(r.loss.item())
    same_grads = all(
        p is not None and (p - q).abs().max().item() <= 1e-5 * q.abs().max().item() + 1e-6 * scale for p, q in pairs
    )
    return ("exact" if same_loss and same_grads else "MISMATCH"), type(model).__name__


def _incremental_logits(model: torch.nn.Module, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of ``ids`` from a cached forward of the first ``prompt`` tokens, then one token per cached call."""
    import inspect

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids[:, :prompt], use_cache=True)
    steps = [out.logits]
    for t in range(prompt, ids.shape[1]):
        out = model(input_ids=ids[:, t:t + 1], use_cache=True, **{key: out.past_key_values})
        steps.append(out.logits)
    return torch.cat(steps, dim=1)


def _enable_checkpointing(model: torch.nn.Module, reentrant: bool) -> None:
    """transformers' gradient checkpointing under this version's name (``activation_checkpointing_enable`` since
    5.24); raises ``ValueError`` where the model does not support it."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def _checkpointed_titans_differs(model: torch.nn.Module, ids: torch.Tensor) -> str | None:
    """Every gradient of the training forward just back-propagated (in ``.grad``) against the same forward under
    gradient checkpointing, reentrant and not (1e-5 of each tensor's largest element, + 1e-6 of the largest of all);
    None if equal or if the model has no checkpointing."""
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    scale = max(g.abs().max().item() for g in ref.values())  # (a key bias's gradient is 0 up to rounding)
    for reentrant in (True, False):
        model.zero_grad(set_to_none=True)
        try:
            _enable_checkpointing(model, reentrant)
        except ValueError:  # does not support checkpointing
            return None
        torch.manual_seed(1)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        for n, g in ref.items():
            if n not in got or (got[n] - g).abs().max() > 1e-5 * g.abs().max() + 1e-6 * scale:
                return f"under {'reentrant' if reentrant else 'non-reentrant'} checkpointing, {n}'s gradient differs"
    (model.activation_checkpointing_disable if hasattr(model, "activation_checkpointing_disable")
     else model.gradient_checkpointing_disable)()
    return None


def check_titans(family: str, vision: bool = False) -> tuple[str, str]:
    """Titans injection (``patch_model(titans=...)`` on the last decoder layer, memory only): the patched model's
    logits equal the original's at step 0, bit for bit; with the memory switched on, a training forward gives every
    memory parameter a finite gradient (some non-zero), the same under gradient checkpointing (reentrant and not);
    and a cached forward (prompt, then one token per call) equals the uncached one, where the unpatched model's own
    cache does (else ``exact, uncached``: trained and checked without a cache only)."""
    import memgrad_hf
    from memgrad_hf.patches.titans import titans_branches
    from memgrad_hf.titans import TitansConfig

    try:
        model = (_tiny_vision(family) if vision else _tiny(family)).eval()
    except Exception as e:
        return "untested", f"tiny config: {_why(e, 90)}"
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else 101
    ids = torch.randint(3, min(vocab, 101), (2, 10), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False).logits.clone()
    except Exception as e:
        return "untested", f"unpatched model fails on the tiny config: {_why(e, 80)}"
    try:  # does the unpatched model's cache reproduce its own uncached logits?
        with torch.no_grad():
            own = _incremental_logits(model, ids, 6)
        has_cache = bool(torch.allclose(own, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()))
    except Exception:
        has_cache = False
    try:
        memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[-1], heads=2, chunk_size=4))
        with torch.no_grad():
            if not torch.equal(model(input_ids=ids, use_cache=False).logits, ref):
                return "MISMATCH", "step 0: the patched model's logits differ from the original's"
            branches = list(titans_branches(model).values())
            g = torch.Generator().manual_seed(3)
            for branch in branches:
                branch.out.weight.copy_(torch.randn(branch.out.weight.shape, generator=g) * 0.5)
        model.train()
        torch.manual_seed(1)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads = [p.grad for b in branches for p in b.parameters() if p.requires_grad]
        if all(q is None for q in grads):  # mllama: a cross-attention layer, skipped without an image
            return "untested", "the last decoder layer does not run in a text-only training forward"
        if not grads or any(q is None or not torch.isfinite(q).all() for q in grads):
            return "MISMATCH", "a memory parameter got no gradient or a non-finite one"
        if not any(q.abs().max() > 0 for q in grads):
            return "MISMATCH", "every memory gradient is zero"
        if (why := _checkpointed_titans_differs(model, ids)) is not None:
            return "MISMATCH", why
        model.eval()
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits
            if torch.allclose(full, ref, atol=1e-6):
                return "MISMATCH", "the switched-on memory does not reach the logits"
            if not has_cache:
                return "exact, uncached", f"{type(model).__name__} (the unpatched model's cache does not match)"
            try:
                inc = _incremental_logits(model, ids, 6)
            except memgrad_hf.UnsupportedModelError as e:
                return "exact, uncached", str(e)[:110]
    except memgrad_hf.UnsupportedModelError as e:
        return "unsupported", str(e)[:110]
    except Exception as e:
        return "ERROR", f"{type(e).__name__}: {str(e)[:100]}"
    if not torch.allclose(inc, full, rtol=1e-4, atol=1e-4 * full.abs().max().item()):
        return "MISMATCH", f"cached forward differs: {(inc - full).abs().max().item():.2e}"
    return "exact", type(model).__name__


def check_forge(family: str, vision: bool = False, steps: int = 2, max_grad_norm: float = 0.05,
                checkpointing: bool = False, logprobs: bool = False, lora: bool = False) -> tuple[str, str]:
    """``ForgeAdamW`` (exact clipping on: ``max_grad_norm`` below the tiny models' gradient norms) on a
    ``patch_model``ed model (the unpatched one where the head is refused) in a hand-written loop, against
    ``torch.optim.AdamW`` + ``clip_grad_norm_`` on the unpatched model: every parameter after ``steps`` steps
    (1e-5 of the largest weight, fp32; eps 1e-3 keeps AdamW's ~lr·sign(g) first step from turning rounding of a
    near-zero gradient element into a whole step). ``checkpointing``: both models under transformers' gradient
    checkpointing (reentrant, as TRL's configs ask for it). ``logprobs``: the loss is TRL's, the mean of per-token
    log-probs computed outside the model, through :func:`memgrad_hf.grpo.add_fused_lm_head` (FORGE updates the head
    in vocabulary blocks) against ``log_softmax`` of the unpatched model's logits. ``lora``: a PEFT LoRA adapter on
    every linear layer (``target_modules="all-linear"``, rank 4, B initialised non-zero) trains instead of the
    model."""
    import memgrad_hf
    from memgrad_hf.optim import ForgeAdamW

    try:
        model = _tiny_vision(family) if vision else _tiny(family)
    except Exception as e:
        return "untested", f"tiny config: {_why(e, 90)}"
    if lora:
        from peft import LoraConfig, get_peft_model

        try:
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                     lora_dropout=0.0, init_lora_weights=False))
        except Exception as e:
            return "untested", f"no LoRA adapter: {_why(e, 90)}"
    try:
        ref, unpatched = copy.deepcopy(model), copy.deepcopy(model)
    except Exception as e:
        return "untested", f"cannot copy the model: {_why(e, 80)}"
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else 101
    ids = torch.randint(3, min(vocab, 101), (2, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :2] = -100
    mask = labels[:, 1:] != -100
    hp = dict(lr=1e-2, eps=1e-3, weight_decay=0.1)

    def ref_loss(m: torch.nn.Module) -> torch.Tensor:
        if not logprobs:
            return m(input_ids=ids, labels=labels).loss
        logits = m(input_ids=ids).logits[:, :-1].float()
        lp = logits.log_softmax(-1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
        return -(lp * mask).sum() / mask.sum()

    if checkpointing:
        try:
            for m in (model, ref, unpatched):
                _enable_checkpointing(m, reentrant=True)
        except Exception as e:
            return "untested", f"no gradient checkpointing: {_why(e, 80)}"
    try:
        opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **hp)
        for _ in range(steps):
            torch.manual_seed(1)
            ref_loss(ref).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
            opt_ref.step()
            opt_ref.zero_grad()
    except Exception as e:
        return "untested", f"unpatched model fails on the tiny config: {_why(e, 80)}"

    def train(model: torch.nn.Module, patch: bool) -> None:
        if patch:
            memgrad_hf.patch_model(model, chunk_size=4)
        if logprobs:
            from memgrad_hf.grpo import add_fused_lm_head

            add_fused_lm_head(model, outputs=("log_probs",))
        opt = ForgeAdamW([p for p in model.parameters() if p.requires_grad], model=model,
                         max_grad_norm=max_grad_norm, **hp)
        for _ in range(steps):
            torch.manual_seed(1)
            if logprobs:  # a loss computed outside the model, as TRL's: through the optimizer's backward
                lp = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
                opt.backward(-(lp * mask).sum() / mask.sum())
            else:
                model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()

    how = "patched head"
    try:
        try:
            train(model, patch=True)
        except memgrad_hf.UnsupportedModelError:  # the head is refused (prophetnet): FORGE alone
            how, model = "unpatched head", unpatched
            train(model, patch=False)
    except memgrad_hf.UnsupportedModelError as e:
        return "unsupported", str(e)[:110]
    except Exception as e:
        return "ERROR", f"{type(e).__name__}: {str(e)[:100]}"
    scale = max(p.abs().max().item() for p in ref.parameters())
    worst, name = max(((p - q).abs().max().item(), n) for (n, p), q in
                      zip(model.named_parameters(), ref.parameters(), strict=True))
    if worst > 1e-5 * scale:
        return "MISMATCH", f"{name}: {worst / scale:.1e} of the largest weight"
    base = model.get_base_model() if lora else model
    return "exact", f"{type(base).__name__} ({how}{', LoRA' if lora else ''}; {worst / scale:.0e})"


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
    p.add_argument("--titans", action="store_true",
                   help="check Titans injection instead: step-0 identity, memory gradients, cached == uncached")
    a = p.parse_args(argv)
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
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    families = a.families or sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if a.vision
                                    else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

    def on_alarm(*_: object) -> None:
        raise _Timeout

    signal.signal(signal.SIGALRM, on_alarm)
    results = {}
    for fam in families:
        signal.alarm(a.timeout)
        try:
            if a.titans:
                results[fam] = check_titans(fam, a.vision)
            elif a.forge:
                results[fam] = check_forge(fam, a.vision, checkpointing=a.checkpointing, logprobs=a.logprobs,
                                           lora=a.lora)
            else:
                results[fam] = check(fam, a.vision, a.logprobs)
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
