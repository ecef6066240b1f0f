"""``Trainer.evaluate()`` of a causal LM, stock vs ``patch_model``ed, side by side (``memgrad-hf bench evaluate``).

Loss-only evaluation (no ``compute_metrics``: what ``Trainer`` does by default) of a Llama-style model built from a
config, on random token batches. Stock transformers builds the ``[batch x seq x vocab]`` logits and throws them
away after the loss; the patched model computes ``eval_loss`` in chunks. Peak memory per configuration in a fresh
process (over the loaded model and data); time round-robin; the two ``eval_loss`` values are printed side by side.
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.harness import Case, bench_parser, machine, peak_added_mib, time_interleaved, versions

PEERS = ("stock", "patched")


def setup(device: str, impl: str, vocab: int, hidden: int, layers: int, batch: int, seq: int, rows: int,
          label_smoothing: float) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    import memgrad_hf

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=seq, tie_word_embeddings=False)).to(device)
    if impl == "patched":
        memgrad_hf.patch_model(model)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (rows, seq), generator=g).tolist()]
    args = TrainingArguments(output_dir="/tmp/memgrad_bench_evaluate", per_device_eval_batch_size=batch,
                             report_to="none", use_cpu=not device.startswith("cuda"), disable_tqdm=True,
                             label_smoothing_factor=label_smoothing)
    trainer = Trainer(model=model, args=args, eval_dataset=data)
    trainer.remove_callback(PrinterCallback)
    return {"trainer": trainer, "out": {}}


def run(s: dict) -> None:
    s["out"] = s["trainer"].evaluate()


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("evaluate", __doc__, vocab=32768, hidden=256, layers=2, batch=8, seq=512)
    p.add_argument("--rows", type=int, default=16, help="evaluation examples")
    p.add_argument("--label_smoothing", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"# Trainer.evaluate(): {a.rows} rows x {a.seq} tokens, eval batch {a.batch}, vocab {a.vocab}, hidden "
          f"{a.hidden}, {a.layers} layers, label smoothing {a.label_smoothing}, fp32, {a.device}\n"
          f"# {machine(a.device)}; {versions()}\n")
    kw = dict(vocab=a.vocab, hidden=a.hidden, layers=a.layers, batch=a.batch, seq=a.seq, rows=a.rows,
              label_smoothing=a.label_smoothing)
    cases = [Case(peer, setup, run, dict(impl=peer, **kw)) for peer in PEERS]
    mem = {c.name: peak_added_mib(c, a.device, a.threads) for c in cases}
    losses: dict = {}
    times = time_interleaved(cases, a.device, repeats=a.repeats, warmup=1, states_out=losses)
    print("| model | peak added (MiB) | vs stock | evaluate() min / median (s) | vs stock | eval_loss |\n"
          "|---|---:|---:|---:|---:|---:|")
    for c in cases:
        m, t = mem[c.name], times.get(c.name)
        if not m["ok"] or not isinstance(t, tuple):
            print(f"| {c.name} | — | | {m.get('error') if not m['ok'] else t} | | |")
            continue
        rm = f"{m['added_mib'] / mem['stock']['added_mib']:.2f}x" if mem["stock"]["ok"] else ""
        rt = f"{t[1] / times['stock'][1]:.2f}x" if isinstance(times.get("stock"), tuple) else ""
        loss = losses[c.name]["out"].get("eval_loss", float("nan"))
        print(f"| {c.name} | {m['added_mib']:.0f} | {rm} | {t[0]:.3f} / {t[1]:.3f} | {rt} | {loss:.6f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
