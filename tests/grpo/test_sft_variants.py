"""TRL's SFTTrainer options that change what reaches the LM head (padding-free rows, packed documents, completion-only
labels, the DFT loss, a MoE model's auxiliary loss): a `patch_model`ed model trains exactly as stock TRL does."""

import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from trl import SFTConfig, SFTTrainer

import memgrad_hf
from memgrad_hf.offline import build_char_tokenizer

TEXTS = ["abc def ghi 123", "jkl mno 456 pqr", "stu vwx 789", "yz abc 0+1=1"] * 4
VARIANTS = {
    "padding_free": {"padding_free": True, "max_length": None},
    "packing": {"packing": True, "max_length": 24},
    "packing_wrapped": {"packing": True, "packing_strategy": "wrapped", "max_length": 16},
    "completion_only": {},
    "dft": {"loss_type": "dft"},
    "moe_aux_loss": {},
}


def _train(tmp_path, variant: str, patched: bool, optim: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    tok = build_char_tokenizer("abc def ghi jkl mno pqr stu vwx yz 0123456789 +-=?")
    torch.manual_seed(0)
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                 eos_token_id=tok.eos_token_id)
    if variant == "moe_aux_loss":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                                   num_experts_per_tok=2, output_router_logits=True,
                                                   router_aux_loss_coef=0.01, **shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=64, max_position_embeddings=128, **shape))
    if patched:
        memgrad_hf.patch_model(model)
    data = Dataset.from_dict({"text": TEXTS})
    if variant == "completion_only":
        data = Dataset.from_dict({"prompt": [t[:5] for t in TEXTS], "completion": [t[5:] for t in TEXTS]})
    # SGD keeps the comparison linear in the gradient (AdamW's first step is ~lr·sign(g), which turns fp32 rounding
    # of a near-zero gradient element into a full lr step); FORGE is compared with AdamW at a large eps instead.
    options = {"max_length": 32, **VARIANTS[variant]}
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, max_steps=2, seed=0,
                     report_to="none", gradient_checkpointing=False, max_grad_norm=1.0, disable_tqdm=True,
                     logging_steps=1, bf16=False, save_strategy="no", learning_rate=1e-2, adam_epsilon=1e-3,
                     optim=optim, **options)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return logged, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _compare(stock, ours, tol: float) -> None:
    (log_a, params_a), (log_b, params_b) = stock, ours
    assert len(log_a) == len(log_b) == 2
    for a, b in zip(log_a, log_b, strict=True):
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy", "aux_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a, b)
    assert log_a[1]["loss"] != log_a[0]["loss"]  # the first step trained
    err = max(((params_a[n] - p).abs().max() / params_a[n].abs().max()).item() for n, p in params_b.items())
    assert err < tol, err


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sft_option_trains_as_stock_trl(tmp_path, variant):
    stock = _train(tmp_path / "stock", variant, patched=False, optim="sgd")
    ours = _train(tmp_path / "ours", variant, patched=True, optim="sgd")
    _compare(stock, ours, tol=1e-6)
    if variant == "moe_aux_loss":
        assert "aux_loss" in stock[0][0]  # the auxiliary loss was on, and logged equal


@pytest.mark.parametrize("variant", ["packing", "completion_only"])
def test_sft_with_forge_adamw_equals_stock_trl_with_adamw_torch(tmp_path, variant):
    # the whole product in SFT: patched head + FORGE with exact clipping against stock TRL + adamw_torch
    stock = _train(tmp_path / "stock", variant, patched=False, optim="adamw_torch")
    ours = _train(tmp_path / "ours", variant, patched=True, optim="forge_adamw")
    _compare(stock, ours, tol=1e-5)
    assert "forge_skipped_steps" in ours[0][0]  # FORGE stepped, not a stock optimizer
