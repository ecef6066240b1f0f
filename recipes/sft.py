"""Supervised fine-tuning with HF Trainer + memgrad_hf (chunked head + FORGE optimizer).

Offline demo (no arguments): a small Llama-style model with a 32K vocabulary, a locally built character tokenizer
and the built-in text; prints the loss curve and a memory/throughput summary.

Real run (downloads from the hub):

    python recipes/sft.py --model Qwen/Qwen2.5-0.5B --dataset tatsu-lab/alpaca --text_field text --max_steps 500 --bf16

Every option: python recipes/sft.py --help
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="hub name or path; default: small offline model")
    p.add_argument("--dataset", default=None, help="hub dataset with a text column; default: built-in text")
    p.add_argument("--text_field", default="text", help="the dataset column with the text (default: %(default)s)")
    p.add_argument("--seq", type=int, default=256, help="tokens per example (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="examples per device step (default: %(default)s)")
    p.add_argument("--max_steps", type=int, default=10, help="optimizer steps (default: %(default)s)")
    p.add_argument("--learning_rate", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--optim", default="forge_adamw",
                   help="any Trainer optimizer name (forge_adamw, adamw_torch, ...) (default: %(default)s)")
    p.add_argument("--optim_args", default=None, help="e.g. state_dtype=bf16 or clip=previous (FORGE)")
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="FORGE clips exactly (default: %(default)s)")
    p.add_argument("--no_patch", action="store_true", help="do not apply memgrad_hf.patch_model")
    p.add_argument("--bf16", action="store_true",
                   help="a hub model loads in bf16, and the Trainer runs bf16 (default: fp32)")
    p.add_argument("--output_dir", default="/tmp/memgrad_sft",
                   help="the trained model is saved here at the end (default: %(default)s)")
    p.add_argument("--save_steps", type=int, default=0,
                   help="also save a resumable checkpoint every N steps (0: none) (default: %(default)s)")
    p.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint dir written with --save_steps")
    a = p.parse_args(argv)

    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainingArguments,
    )

    import memgrad_hf
    from memgrad_hf.callbacks import MemoryReportCallback
    from memgrad_hf.offline import DEMO_TEXT, build_char_tokenizer, lm_blocks

    if a.model is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        tok = build_char_tokenizer()
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=32768, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=max(a.seq, 256), pad_token_id=tok.pad_token_id))
    else:
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    text = DEMO_TEXT
    if a.dataset:  # (with the demo model too: its character tokenizer takes any text)
        from datasets import load_dataset

        text = "\n\n".join(load_dataset(a.dataset, split="train")[a.text_field][:20000])
    data = lm_blocks(tok, text, a.seq, a.max_steps * a.batch)
    if not a.no_patch:
        memgrad_hf.patch_model(model)
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=a.batch,
        learning_rate=a.learning_rate, logging_steps=1, report_to="none", bf16=a.bf16,
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
        use_cpu=not torch.cuda.is_available(), optim=a.optim, optim_args=a.optim_args,
        max_grad_norm=a.max_grad_norm, disable_tqdm=True, dataloader_num_workers=0,
    )
    cb = MemoryReportCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    trainer.save_model(a.output_dir)  # a plain transformers checkpoint (memgrad's patch is not saved)
    tok.save_pretrained(a.output_dir)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        print(f"step {h['step']:>4}  loss {h['loss']:.4f}  grad_norm {h.get('grad_norm', float('nan')):.3f}")
    ran = cb.summary.get("steps", len(logs))  # (after a resume, the steps this run took)
    print(f"\nSFT done: {ran} steps in {time.perf_counter() - t0:.1f} s"
          + (f" (resumed at step {trainer.state.global_step - ran})" if a.resume_from_checkpoint else "")
          + f"; optimizer {a.optim}; "
          f"head {'memgrad' if not a.no_patch else 'stock'}; peak memory added {cb.summary.get('peak_added_mem_mb')} "
          f"MB; {cb.summary.get('tokens_per_s')} tokens/s; saved to {a.output_dir}")
    return 0


if __name__ == "__main__":
    from memgrad_hf.offline import run_recipe

    sys.exit(run_recipe(main))
