"""A ``patch_model``ed model gets memgrad's fused head in TRL trainers whatever the import order (TRL loads its trainer
modules lazily, often after ``patch_model``), and so does the trainer's reference model."""

import os
import subprocess
import sys

# A fresh interpreter: in the test process TRL's trainer modules are already imported by other tests.
_SCRIPT = r"""
import sys
import torch
import memgrad_hf
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from memgrad_hf.offline import build_char_tokenizer

tok = build_char_tokenizer("abc def 0123456789 +-=")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
model.save_pretrained(sys.argv[1])  # TRL builds the reference model from the model's path
model = LlamaForCausalLM.from_pretrained(sys.argv[1])
memgrad_hf.patch_model(model)
assert "trl.trainer.grpo_trainer" not in sys.modules  # the order that used to leave TRL's head in place
from trl import GRPOConfig, GRPOTrainer

args = GRPOConfig(output_dir=sys.argv[1], use_cpu=True, per_device_train_batch_size=2, num_generations=2,
                  max_completion_length=4, max_steps=1, report_to="none", save_strategy="no", bf16=False,
                  use_vllm=False, beta=0.04)
trainer = GRPOTrainer(model=model, args=args, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                      train_dataset=Dataset.from_dict({"prompt": ["abc", "1+2="]}), processing_class=tok)
for name in ("model", "ref_model"):
    forward = getattr(trainer, name).forward
    print(name, forward.__func__.__code__.co_filename)
"""


def test_patch_model_before_trl_import_routes_policy_and_reference(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if line.startswith(("model ", "ref_model ")))
    assert set(lines) == {"model", "ref_model"}
    for name, path in lines.items():
        assert os.path.join("memgrad_hf", "grpo") in path, f"{name} runs {path}, not memgrad's fused head"
