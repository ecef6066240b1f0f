"""Masked-LM training under HF ``Trainer``, stock vs ``patch_model``ed (``memgrad-hf bench masked_lm``).

A ModernBERT-style encoder built from a config (ModernBERT's 50368-word vocabulary by default), trained for a few
``Trainer`` steps on random tokens with 30% of the positions as targets (ModernBERT's masking rate). Stock
transformers builds the ``[batch x seq x vocab]`` logits at every position, targets or not; the patched model
computes the loss in chunks over the target positions only. Peers: ``stock``, ``patched``, and ``patched+forge``
(``optim="forge_adamw"``). Peak memory per configuration in a fresh process (over the loaded model and data); time
per ``train()`` round-robin; the final training losses side by side (same numbers out).
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.harness import Case, bench_parser, machine, peak_added_mib, time_interleaved, versions

PEERS = ("stock", "patched", "patched+forge")


def setup(device: str, impl: str, vocab: int, hidden: int, layers: int, batch: int, seq: int, steps: int,
          mask_rate: float, bf16: bool = False) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import ModernBertConfig, ModernBertForMaskedLM, TrainingArguments
    from transformers.utils import logging as hf_logging

    import memgrad_hf

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(1.5 * hidden), num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1), max_position_embeddings=seq, pad_token_id=0,
        global_attn_every_n_layers=3, local_attention=128)).to(device)
    if impl != "stock":
        memgrad_hf.patch_model(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch * steps, seq), generator=g)
    labels = torch.where(torch.rand(ids.shape, generator=g) < mask_rate, ids, -100)
    data = [{"input_ids": i, "labels": t} for i, t in zip(ids.tolist(), labels.tolist(), strict=True)]
    args = TrainingArguments(output_dir="/tmp/memgrad_bench_masked_lm", per_device_train_batch_size=batch,
                             max_steps=steps, learning_rate=1e-4, logging_steps=1, save_strategy="no",
                             report_to="none", use_cpu=not device.startswith("cuda"), disable_tqdm=True, seed=0,
                             data_seed=0, optim="forge_adamw" if impl.endswith("forge") else "adamw_torch", bf16=bf16)
    return {"model": model, "args": args, "data": data, "losses": []}


def run(s: dict) -> None:
    from transformers import PrinterCallback, Trainer

    trainer = Trainer(model=s["model"], args=s["args"], train_dataset=s["data"])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    s["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("masked_lm", __doc__, vocab=50368, hidden=256, layers=2, batch=8, seq=512)
    p.add_argument("--steps", type=int, default=2, help="Trainer steps per run")
    p.add_argument("--mask-rate", type=float, default=0.3, help="share of positions that are targets")
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    p.add_argument("--bf16", action="store_true", help="Trainer's bf16 mixed precision (fp32 weights)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"# Trainer.train(), masked LM (ModernBERT-style): {a.steps} steps of {a.batch} x {a.seq} tokens, "
          f"{a.mask_rate:.0%} targets, vocab {a.vocab}, hidden {a.hidden}, {a.layers} layers, "
          f"{'bf16 autocast' if a.bf16 else 'fp32'}, {a.device}\n"
          f"# {machine(a.device)}; {versions()}\n")
    kw = dict(vocab=a.vocab, hidden=a.hidden, layers=a.layers, batch=a.batch, seq=a.seq, steps=a.steps,
              mask_rate=a.mask_rate, bf16=a.bf16)
    cases = [Case(peer, setup, run, dict(impl=peer, **kw)) for peer in a.peers]
    mem = {c.name: peak_added_mib(c, a.device, a.threads) for c in cases}
    states: dict = {}
    # (on a GPU a first, untimed run takes the one-time costs: kernel compilation, cuBLAS workspaces)
    times = time_interleaved(cases, a.device, repeats=a.repeats, warmup=int(a.device.startswith("cuda")),
                             states_out=states)
    ref = a.peers[0]
    print(f"| peer | peak added (MiB) | vs {ref} | train() min / median (s) | vs {ref} | losses |\n"
          "|---|---:|---:|---:|---:|---|")
    for c in cases:
        m, t = mem[c.name], times.get(c.name)
        if not m["ok"] or not isinstance(t, tuple):
            print(f"| {c.name} | — | | {m.get('error') if not m['ok'] else t} | | |")
            continue
        rm = f"{m['added_mib'] / mem[ref]['added_mib']:.2f}x" if mem[ref]["ok"] else ""
        rt = f"{t[1] / times[ref][1]:.2f}x" if isinstance(times.get(ref), tuple) else ""
        losses = ", ".join(f"{v:.6f}" for v in states[c.name]["losses"])
        print(f"| {c.name} | {m['added_mib']:.0f} | {rm} | {t[0]:.3f} / {t[1]:.3f} | {rt} | {losses} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
