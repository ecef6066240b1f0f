"""Same-seed verification: a Titans-augmented LM trained twice from one seed, inner gradient by torch.func vs manual.

Both runs build the same model (same seed), inject the same neural-memory layers, see the same batches in the same
order under HF Trainer; the only difference is how the memory's inner gradient is computed:
``grad_impl="autograd"`` (``torch.func.vmap(grad(...))``, the reference) or ``grad_impl="manual"`` (memgrad_hf's
kernel). The loss / bits-per-character curves should agree to float noise. What float noise amounts to is measured,
not assumed: a third run repeats the reference with every initial weight nudged by one unit in the last place, and its
gap to the reference is printed beside the manual kernel's (training amplifies any rounding difference with the steps;
the manual kernel's gap should be no larger than this floor's). Also printed: the largest relative difference of the
trained weights (per tensor, over its largest element) and the median time per step of each run. Read it against the
floor's too: in the first steps a tensor whose gradient is still at rounding level (a zero-initialised output
projection, for instance) moves by Adam's ±lr per element with a sign that rounding decides, so its difference can
reach 2 in the floor run as well.

Offline demo (no arguments): a small Llama-style model over a local character tokenizer and the built-in text.

    python recipes/titans_same_seed.py
    python recipes/titans_same_seed.py --steps 50 --seq 256 --layers 0 1 --depth 3 --activation silu

Every option: python recipes/titans_same_seed.py --help
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def _train(a, impl: str, tok, data, nudge: bool = False) -> tuple[list[float], float, list]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    import memgrad_hf
    from memgrad_hf.callbacks import MemoryReportCallback
    from memgrad_hf.titans import TitansConfig

    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.n_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(a.seq, 64),
        pad_token_id=tok.pad_token_id, tie_word_embeddings=True)).to(getattr(torch, a.dtype))
    titans = TitansConfig(layers=a.layers, heads=a.mem_heads, depth=a.depth, activation=a.activation,
                          chunk_size=a.chunk_size, grad_impl=impl)
    memgrad_hf.patch_model(model, titans=titans)
    if nudge:  # the noise floor: every initial weight moved by about one unit in the last place
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + torch.finfo(p.dtype).eps)
    args = TrainingArguments(
        output_dir=f"/tmp/memgrad_titans_same_seed_{impl}", max_steps=a.steps, per_device_train_batch_size=a.batch,
        learning_rate=a.learning_rate, warmup_steps=2, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), seed=a.seed, disable_tqdm=True, dataloader_num_workers=0,
        max_grad_norm=1.0,
    )
    # The losses are read from the model's outputs at full precision (the Trainer's logged loss goes through an fp32
    # accumulator, which would hide float64 differences).
    losses: list[float] = []
    model.register_forward_hook(lambda mod, inp, out: losses.append(out.loss.item()) if mod.training else None)
    report = MemoryReportCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[report])
    trainer.train()
    return losses, report.summary["step_time_s"], [p.detach().clone() for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of each run (default: %(default)s)")
    p.add_argument("--seq", type=int, default=128, help="tokens per example (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="examples per step (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the small model (default: %(default)s)")
    p.add_argument("--n_layers", type=int, default=2, help="decoder layers of the small model (default: %(default)s)")
    p.add_argument("--layers", type=int, nargs="+", default=[1],
                   help="decoder layers that get a memory (default: %(default)s)")
    p.add_argument("--mem_heads", type=int, default=2, help="heads of each memory (default: %(default)s)")
    p.add_argument("--depth", type=int, default=2, help="memory MLP depth (1-4) (default: %(default)s)")
    p.add_argument("--activation", default="gelu", choices=["gelu", "silu"],
                   help="memory MLP activation (default: %(default)s)")
    p.add_argument("--chunk_size", type=int, default=16, help="tokens per memory update (default: %(default)s)")
    p.add_argument("--learning_rate", type=float, default=1e-3, help="outer learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the seed both runs share (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                   help="float64: the two runs differ only where HF rounds to float32 (it computes the loss in "
                        "float32); float32: rounding differences of the two gradients grow with the steps")
    p.add_argument("--no_floor", action="store_true",
                   help="skip the noise-floor run (the reference again, initial weights nudged by one ulp)")
    p.add_argument("--text", default=None, help="path of a text file to train on; default: built-in text")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from memgrad_hf.offline import DEMO_TEXT, build_char_tokenizer, lm_blocks

    text = open(a.text, encoding="utf-8").read() if a.text else DEMO_TEXT
    tok = build_char_tokenizer(text)
    data = lm_blocks(tok, text, a.seq, a.steps * a.batch)
    runs = {"autograd": ("autograd", False), "manual": ("manual", False), "floor": ("autograd", True)}
    if a.no_floor:
        runs.pop("floor")
    curves, times, weights = {}, {}, {}
    for name, (impl, nudge) in runs.items():
        print(f"training with grad_impl={impl!r}{' (initial weights nudged by 1 ulp)' if nudge else ''} ...",
              flush=True)
        curves[name], times[name], weights[name] = _train(a, impl, tok, data, nudge)
    ref, man = curves["autograd"], curves["manual"]
    floor = curves.get("floor")
    print(f"\n{'step':>5} {'loss autograd':>16} {'loss manual':>16} {'BPC autograd':>13} {'BPC manual':>11} "
          f"{'gap':>9}{'  floor gap' if floor else ''}")
    for i, (r, m) in enumerate(zip(ref, man, strict=True)):
        extra = f" {abs(r - floor[i]):>10.2e}" if floor else ""
        print(f"{i + 1:>5} {r:>16.10f} {m:>16.10f} {r / math.log(2):>13.6f} {m / math.log(2):>11.6f} "
              f"{abs(r - m):>9.2e}{extra}")

    def gaps(other: str) -> tuple[float, float]:
        loss_gap = max(abs(r - o) for r, o in zip(ref, curves[other], strict=True))
        w_gap = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
                    for x, y in zip(weights["autograd"], weights[other], strict=True))
        return loss_gap, w_gap

    gap, w_gap = gaps("manual")
    print(f"\nsame-seed check: {len(ref)} steps, largest loss gap {gap:.3e} (BPC {gap / math.log(2):.3e}); "
          f"largest relative difference of the trained weights {w_gap:.3e}; "
          f"median time/step autograd {times['autograd']:.3f} s, manual {times['manual']:.3f} s")
    if floor:
        f_gap, f_w = gaps("floor")
        print(f"noise floor (autograd vs autograd with 1-ulp nudged initial weights): largest loss gap {f_gap:.3e}; "
              f"largest relative weight difference {f_w:.3e}")
    return 0


if __name__ == "__main__":
    from memgrad_hf.offline import run_recipe

    sys.exit(run_recipe(main))
