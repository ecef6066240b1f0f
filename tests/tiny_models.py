"""Tiny causal LMs built from configs (no hub), one per family, for exactness tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 101
_COMMON = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=64, head_dim=8, pad_token_id=0,
)
_LINEAR_ATTN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
# Families whose configs use other field names, or that carry a logit rewrite worth exercising.
_OVERRIDES: dict[str, dict] = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, vocab_size=VOCAB),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
                vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB),
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB),
    "gemma2": dict(_COMMON, final_logit_softcapping=3.0),
    "gemma3_text": dict(_COMMON, final_logit_softcapping=3.0),
    "nanochat": dict(_COMMON, final_logit_softcapping=3.0),
    "granite": dict(_COMMON, logits_scaling=4.0),
    "granitemoe": dict(_COMMON, logits_scaling=4.0, num_local_experts=4, num_experts_per_tok=2),
    "hyperclovax": dict(_COMMON, logits_scaling=0.5),
    "cohere": dict(_COMMON, logit_scale=0.25),
    "cohere2": dict(_COMMON, logit_scale=0.25),
    "mixtral": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                    router_aux_loss_coef=0.02),
    "qwen2_moe": dict(_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, output_router_logits=True),
    # hybrid: one gated-delta-net (linear attention) layer and one full-attention layer
    "qwen3_5_text": dict(_COMMON, layer_types=["linear_attention", "full_attention"], **_LINEAR_ATTN),
    "qwen3_next": dict(_COMMON, layer_types=["linear_attention", "full_attention"], **_LINEAR_ATTN, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       output_router_logits=True),
    # sliding + full attention, per-layer inputs, full-attention layer with its own (wider) head_dim, softcapping
    "gemma4_text": dict(_COMMON, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                        per_layer_config={1: {"head_dim": 16}}, final_logit_softcapping=3.0),
    # decoders that apply nn.CrossEntropyLoss to their own (unshifted) logits instead of self.loss_function
    "bart": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=64),
    "whisper": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                    max_target_positions=64, max_source_positions=64, pad_token_id=0),
    # multi-head latent attention; a dense layer then a MoE layer with a shared expert
    "deepseek_v3": dict(_COMMON, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                        moe_intermediate_size=32),
}

# The families the head patch is tested on (issue 2 names the first eleven).
FAMILIES = [
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "opt", "granite", "cohere",
    "gemma", "cohere2", "olmo2", "phi", "starcoder2", "stablelm", "gpt_neox", "mixtral", "qwen2_moe", "hyperclovax",
    "nanochat", "smollm3", "glm", "falcon", "bloom", "gptj", "mpt", "ministral", "exaone4", "helium", "seed_oss",
    "granitemoe", "bart", "whisper", "qwen3_5_text", "gemma4_text", "deepseek_v3", "qwen3_next",
]


def tiny_config(family: str, tied: bool = False, **extra):
    kw = dict(_OVERRIDES.get(family, _COMMON))
    kw.update(tie_word_embeddings=tied, **extra)
    kw.setdefault("pad_token_id", 0)
    return AutoConfig.for_model(family, **kw)


def tiny_model(family: str = "llama", tied: bool = False, seed: int = 0, **extra):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tied, **extra)).float()
    return model


class WordScaledHead(torch.nn.Linear):
    """An LM head module with a forward of its own: a learned scale per word after its linear (as transformers
    5.24's dory), then ``post`` (a callable on the logits, e.g. something the chunked head cannot reproduce)."""

    def __init__(self, linear: torch.nn.Linear, bias: bool = False, post=None):
        super().__init__(linear.in_features, linear.out_features, bias=bias)
        with torch.no_grad():
            self.weight.copy_(linear.weight)
            if bias:
                self.bias.normal_()
        self.word_scale = torch.nn.Parameter(torch.rand(linear.out_features) + 0.5)
        self.post = post

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden_states).float() * (self.word_scale * 2.0)
        return logits if self.post is None else self.post(self, logits)


def with_word_scaled_head(model, bias: bool = False, post=None):
    """``model`` (untied) with its ``lm_head`` replaced by a :class:`WordScaledHead` of the same weight."""
    torch.manual_seed(1)
    model.set_output_embeddings(WordScaledHead(model.get_output_embeddings(), bias=bias, post=post))
    return model
