"""``memgrad-hf demo``: the same training run with and without memgrad_hf, side by side.

A small Llama-style model with a realistic vocabulary (32768 by default) is built from a config, trained with HF
``Trainer`` on built-in text with a locally built tokenizer, once per configuration, each in a fresh process
(so that peak memory is that configuration's own). The table shows peak memory, time per step, the final loss
and the largest per-step loss difference from the stock run. Numbers come from
:class:`memgrad_hf.callbacks.MemoryReportCallback`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

CONFIGS = {
    "stock": "HF Trainer, unpatched model",
    "patched": "memgrad_hf.patch_model(model)",
}


def _forge_available() -> bool:
    try:
        from transformers.training_args import OptimizerNames

        import memgrad_hf  # noqa: F401  (registers optimizers)

        return "forge_adamw" in [o.value for o in OptimizerNames]
    except Exception:
        return False


@dataclass
class DemoOptions:
    steps: int = 8
    batch: int = 8
    seq: int = 256
    vocab: int = 32768
    hidden: int = 256
    layers: int = 2
    lr: float = 1e-3
    seed: int = 0
    threads: int = 0  # 0: OMP_NUM_THREADS if set, else 2 (the demo sets torch's threads itself)
    bf16: bool = False


def _run_one(name: str, opts: dict, q: Any) -> None:
    try:
        q.put(run_config(name, DemoOptions(**opts)))
    except Exception as e:  # the parent prints it as a row
        import traceback

        q.put({"name": name, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()})


def _threads(asked: int) -> int:
    """``asked``, or for 0 ``OMP_NUM_THREADS`` if set, else 2 (torch.set_num_threads would override the variable)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return asked or (int(env) if env.isdigit() and int(env) > 0 else 2)


def run_config(name: str, o: DemoOptions) -> dict:
    """Train one configuration in this process; return its losses and the memory/throughput summary."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    import memgrad_hf
    from memgrad_hf.callbacks import MemoryReportCallback
    from memgrad_hf.offline import DEMO_TEXT, build_char_tokenizer, lm_blocks

    hf_logging.set_verbosity_error()
    torch.set_num_threads(_threads(o.threads))
    cuda = torch.cuda.is_available()
    tok = build_char_tokenizer()
    data = lm_blocks(tok, DEMO_TEXT, o.seq, o.steps * o.batch)
    torch.manual_seed(o.seed)
    cfg = LlamaConfig(
        vocab_size=o.vocab, hidden_size=o.hidden, intermediate_size=4 * o.hidden, num_hidden_layers=o.layers,
        num_attention_heads=max(o.hidden // 64, 1), num_key_value_heads=max(o.hidden // 128, 1),
        max_position_embeddings=max(o.seq, 256), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    if name in ("patched", "patched+forge"):
        memgrad_hf.patch_model(model)
    optim = "forge_adamw" if name.endswith("forge") else "adamw_torch"
    args = TrainingArguments(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "memgrad_demo"), max_steps=o.steps,
        per_device_train_batch_size=o.batch, learning_rate=o.lr, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=not cuda, bf16=o.bf16, seed=o.seed, data_seed=o.seed,
        dataloader_num_workers=0, optim=optim, max_grad_norm=0.0,  # same for every run (FORGE would clip exactly,
        # at the cost of its weight-gradient GEMMs twice; see the README)
        disable_tqdm=True,
    )
    cb = MemoryReportCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.remove_callback(PrinterCallback)  # the demo prints its own table
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"name": name, "losses": losses, **cb.summary, "device": "cuda" if cuda else "cpu"}


def _fmt_table(rows: list[dict], stock: dict | None) -> str:
    lines = [
        "| configuration | peak memory added (MB) | vs stock | time/step (s) | tokens/s | final loss "
        "| max loss diff vs stock |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} | | | | | |")
            continue
        ratio = diff = ""
        if stock and "error" not in stock:
            ratio = f"{r['peak_added_mem_mb'] / max(stock['peak_added_mem_mb'], 1e-9):.2f}x"
            n = min(len(r["losses"]), len(stock["losses"]))
            diff = f"{max(abs(a - b) for a, b in zip(r['losses'][:n], stock['losses'][:n], strict=True)):.2e}"
        lines.append(
            f"| {r['name']} | {r['peak_added_mem_mb']:.0f} | {ratio} | {r['step_time_s']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['losses'][-1]:.4f} | {diff} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memgrad-hf demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DemoOptions()
    for f, v in asdict(d).items():
        if isinstance(v, bool):
            p.add_argument(f"--{f}", action="store_true", help=f"(default {v})")
        else:
            p.add_argument(f"--{f}", type=type(v), default=v,
                           help="(default: OMP_NUM_THREADS if set, else 2)" if f == "threads" else f"(default {v})")
    p.add_argument("--configs", default=None,
                   help="comma-separated subset of: stock, patched, patched+forge (default: all available)")
    a = p.parse_args(argv)
    opts = DemoOptions(**{f: getattr(a, f) for f in asdict(d)})
    opts.threads = _threads(opts.threads)
    names = a.configs.split(",") if a.configs else ["stock", "patched"] + (["patched+forge"] if _forge_available()
                                                                           else [])
    from memgrad_hf.offline import build_char_tokenizer

    symbols = len(build_char_tokenizer())
    if opts.vocab < symbols:  # (every row failed with an IndexError in the embedding)
        p.error(f"--vocab {opts.vocab}: the demo's tokenizer has {symbols} symbols; pass --vocab {symbols} or more")
    small = [f for f in ("steps", "batch", "seq", "hidden", "layers", "threads") if getattr(opts, f) < 1]
    if small:
        p.error(f"--{small[0]} must be at least 1; got {getattr(opts, small[0])}")
    unknown = [n for n in names if n not in ("stock", "patched", "patched+forge")]
    if unknown:  # (a typo ran an unpatched run under its name; "forge" ran FORGE on an unpatched model)
        p.error(f"--configs: unknown {', '.join(unknown)}; choose from stock, patched, patched+forge")
    print(f"memgrad-hf demo: Llama-style model, vocab {opts.vocab}, hidden {opts.hidden}, {opts.layers} layers; "
          f"{opts.steps} steps of {opts.batch}x{opts.seq} tokens, no gradient clipping; one fresh process per "
          "configuration.", flush=True)
    ctx = mp.get_context("spawn")
    rows = []
    # glibc returns freed blocks >= 64 KiB to the OS in the children, so peak RSS tracks live tensors
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    for name in names:
        q = ctx.Queue()
        proc = ctx.Process(target=_run_one, args=(name, asdict(opts), q))
        proc.start()
        res = q.get()
        proc.join()
        rows.append(res)
        msg = res.get("error") or f"peak +{res['peak_added_mem_mb']:.0f} MB, {res['step_time_s']:.3f} s/step"
        print(f"  {name:14s} done: {msg}", flush=True)
    stock = next((r for r in rows if r["name"] == "stock"), None)
    print()
    print(_fmt_table(rows, stock))
    dev = next((r.get("device") for r in rows if "device" in r), "?")
    print(f"\nDevice: {dev}. Peak memory: {'CUDA allocator peak' if dev == 'cuda' else 'process peak RSS'} during "
          "training minus memory in use when training started.")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
