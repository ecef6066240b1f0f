"""TRL's RewardTrainer (a sequence classifier scoring chosen against rejected) with ``--optim forge_adamw``: the score
head and every other weight trained through FORGE (exact clipping on) equal stock TRL with ``adamw_torch``."""

import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForSequenceClassification
from trl import RewardConfig, RewardTrainer

import memgrad_hf  # noqa: F401  (registers forge_adamw)
from memgrad_hf.offline import build_char_tokenizer


def _train(tmp_path, optim: str, centered: bool) -> tuple[list[dict], dict[str, torch.Tensor]]:
    tok = build_char_tokenizer("abc def ghi jkl mno pqr stu vwx yz 0123456789 +-=?")
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), max_position_embeddings=64, num_labels=1, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    data = Dataset.from_dict({"chosen": ["1+2=3", "abc def", "9-3=6", "ghi"] * 4,
                              "rejected": ["1+2=4", "zz", "9-3=7", "yy yy"] * 4})
    args = RewardConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, max_steps=3, seed=0,
                        report_to="none", max_grad_norm=0.05, disable_tqdm=True, logging_steps=1, bf16=False,
                        save_strategy="no", learning_rate=1e-2, adam_epsilon=1e-3, optim=optim,
                        center_rewards_coefficient=0.01 if centered else None)
    trainer = RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return logged, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("centered", [False, True], ids=["plain", "centered_rewards"])
def test_reward_trainer_with_forge_adamw_equals_adamw_torch(tmp_path, centered):
    (log_a, params_a), (log_b, params_b) = (_train(tmp_path / o, o, centered) for o in ("adamw_torch", "forge_adamw"))
    assert len(log_a) == len(log_b) == 3
    for a, b in zip(log_a, log_b, strict=True):
        for key in ("loss", "grad_norm", "accuracy", "margin"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a, b)
    assert log_a[0]["grad_norm"] > 0.05  # clipping was active
    err = max(((params_a[n] - p).abs().max() / params_a[n].abs().max()).item() for n, p in params_b.items())
    assert err < 1e-5, err
