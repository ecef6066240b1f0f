"""GRPO with TRL's GRPOTrainer + memgrad_hf (chunked head + FORGE optimizer).

Offline demo (no arguments): a tiny Llama-style model, a locally built character tokenizer and synthetic
arithmetic prompts, rewarded for the correct answer; runs end to end on a CPU in well under 3 minutes.

Real run (downloads from the hub):

    python recipes/grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --max_steps 200 --bf16

Every option: python recipes/grpo.py --help
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time


def arithmetic_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def correctness_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """1 for a completion whose first number equals the answer, else 0 (minus a small length penalty)."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        text = c if isinstance(c, str) else c[-1]["content"]
        m = re.search(r"-?\d+", text.replace(",", ""))
        out.append((1.0 if m and m.group(0) == a else 0.0) - 0.001 * len(text))
    return out


def gsm8k_rows(name: str) -> list[dict]:
    from datasets import load_dataset

    ds = load_dataset(name, "main", split="train")
    suffix = "\nAnswer with the final number."
    return [{"prompt": r["question"] + suffix, "answer": r["answer"].split("####")[-1].strip()} for r in ds]


def _no_checkpointing(config_cls: type) -> dict:
    """Activation checkpointing off (TRL's configs turn it on), under the installed transformers' name for it
    (``activation_checkpointing`` since 5.24, where ``gradient_checkpointing`` is deprecated)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_cls)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": False}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="hub name or path; default: tiny offline model")
    p.add_argument("--dataset", default=None, help="hub dataset (gsm8k format); default: synthetic arithmetic")
    p.add_argument("--max_steps", type=int, default=6, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="completions per device step (default: %(default)s)")
    p.add_argument("--num_generations", type=int, default=4,
                   help="completions per prompt (GRPO's group) (default: %(default)s)")
    p.add_argument("--max_completion_length", type=int, default=8, help="tokens per completion (default: %(default)s)")
    p.add_argument("--learning_rate", type=float, default=5e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--optim", default="forge_adamw",
                   help="any Trainer optimizer name (forge_adamw, adamw_torch, ...) (default: %(default)s)")
    p.add_argument("--optim_args", default="",
                   help="FORGE options, e.g. 'clip=previous' (clip with the previous step's exact norm) or "
                        "'state_dtype=bf16'; the default clips exactly (optim_args clip_pass in the README)")
    p.add_argument("--no_patch", action="store_true", help="do not apply memgrad_hf.patch_model")
    p.add_argument("--bf16", action="store_true",
                   help="a hub model loads in bf16, and the Trainer runs bf16 (default: fp32)")
    p.add_argument("--output_dir", default="/tmp/memgrad_grpo",
                   help="the trained model is saved here at the end (default: %(default)s)")
    p.add_argument("--save_steps", type=int, default=0,
                   help="also save a resumable checkpoint every N steps (0: none) (default: %(default)s)")
    p.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint dir written with --save_steps")
    a = p.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import memgrad_hf
    from memgrad_hf.callbacks import MemoryReportCallback
    from memgrad_hf.offline import build_char_tokenizer

    if a.model is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        tok = build_char_tokenizer("0123456789+=- abcdefghijklmnopqrstuvwxyz")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=len(tok), max_position_embeddings=128, pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    else:
        tok = AutoTokenizer.from_pretrained(a.model, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    rows = gsm8k_rows(a.dataset) if a.dataset else arithmetic_prompts(max(64, a.max_steps * a.batch))
    data = Dataset.from_list(rows)
    if not a.no_patch:
        memgrad_hf.patch_model(model)
    args = GRPOConfig(
        output_dir=a.output_dir, per_device_train_batch_size=a.batch, num_generations=a.num_generations,
        max_completion_length=a.max_completion_length, max_steps=a.max_steps, learning_rate=a.learning_rate,
        logging_steps=1, report_to="none", bf16=a.bf16, use_cpu=not torch.cuda.is_available(),
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
        optim=a.optim, **_no_checkpointing(GRPOConfig),
        optim_args=(a.optim_args or None) if a.optim.startswith("forge") else None,
        use_vllm=False, disable_tqdm=True,
    )
    cb = MemoryReportCallback()
    trainer = GRPOTrainer(model=model, args=args, reward_funcs=correctness_reward, train_dataset=data,
                          processing_class=tok, callbacks=[cb])
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    trainer.save_model(a.output_dir)  # a plain transformers checkpoint (memgrad's patch is not saved)
    tok.save_pretrained(a.output_dir)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        print(f"step {h['step']:>3}  loss {h['loss']:+.4f}  reward {h.get('reward', float('nan')):+.3f}  "
              f"grad_norm {h.get('grad_norm', float('nan')):.3f}")
    ran = cb.summary.get("steps", len(logs))  # (after a resume, the steps this run took)
    print(f"\nGRPO done: {ran} steps in {time.perf_counter() - t0:.1f} s"
          + (f" (resumed at step {trainer.state.global_step - ran})" if a.resume_from_checkpoint else "")
          + f"; optimizer {a.optim}; "
          f"head {'memgrad' if not a.no_patch else 'TRL'}; peak memory added {cb.summary.get('peak_added_mem_mb')} MB; "
          f"{cb.summary.get('tokens_per_s')} tokens/s; saved to {a.output_dir}")
    return 0


if __name__ == "__main__":
    from memgrad_hf.offline import run_recipe

    sys.exit(run_recipe(main))
