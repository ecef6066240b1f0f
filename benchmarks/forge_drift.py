"""How far reduced-precision optimizer state takes training from fp32 AdamW (``memgrad-hf bench forge_drift``).

The same small Llama-style model, data and seed trained with HF ``Trainer`` under each optimizer; the table gives the
optimizer state's size, the training loss along the way and, at the end, each run's distance from the reference's
(``adamw_torch``'s) weights relative to how far the reference moved them (``‖W - W_ref‖ / ‖W_ref - W_0‖`` over all
parameters). FORGE with fp32 state should sit at float noise; bf16 and 8-bit state (FORGE's, and bitsandbytes'
``adamw_bnb_8bit`` when installed) show what their rounding costs, and ``adamw_torch+other_order`` (the same
training, its batches in another order) the scale of it. ``--reference forge_lion --lr 3e-4 --configs
forge_lion+bf16_state forge_lion+8bit_state``: the same for Lion's state. ``--bf16``: every optimizer trains bf16
weights, and the reference is its config on fp32 weights (the training bf16 stands in for): torch's round-to-nearest
bf16 weights lose the updates below half a bf16 spacing, FORGE's ``stochastic_rounding=true`` keeps them on average.
Trained on the built-in text with a character tokenizer (no download).
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.forge import llama_config
from benchmarks.harness import bench_parser, machine, versions

CONFIGS = {
    "adamw_torch": dict(optim="adamw_torch"),
    "forge_adamw": dict(optim="forge_adamw"),
    "forge_adamw+bf16_state": dict(optim="forge_adamw", optim_args="state_dtype=bf16"),
    "forge_adamw+8bit_state": dict(optim="forge_adamw", optim_args="state_dtype=8bit"),
    "adamw_bnb_8bit": dict(optim="adamw_bnb_8bit"),  # needs bitsandbytes (its CPU build runs here)
    # the scale of it all: the same optimizer, only the order of the batches differs (Trainer seed 1)
    "adamw_torch+other_order": dict(optim="adamw_torch", seed=1),
    "forge_adamw+sr": dict(optim="forge_adamw", optim_args="stochastic_rounding=true"),  # for --bf16
    "forge_adamw+8bit_state+sr": dict(optim="forge_adamw", optim_args="state_dtype=8bit,stochastic_rounding=true"),
    # Lion's reduced-precision state against its fp32 state: --reference forge_lion (lr 3e-4 suits it)
    "forge_lion": dict(optim="forge_lion"),
    "forge_lion+bf16_state": dict(optim="forge_lion", optim_args="state_dtype=bf16"),
    "forge_lion+8bit_state": dict(optim="forge_lion", optim_args="state_dtype=8bit"),
}
DEFAULT = ["adamw_torch", "forge_adamw", "forge_adamw+bf16_state", "forge_adamw+8bit_state", "adamw_bnb_8bit",
           "adamw_torch+other_order"]
DEFAULT_BF16 = ["adamw_torch", "forge_adamw", "forge_adamw+sr", "forge_adamw+8bit_state+sr", "adamw_bnb_8bit"]


def _model(hidden: int, layers: int, vocab: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(vocab, hidden, layers, 256))


def train(config: str, *, hidden: int, layers: int, seq: int, batch: int, steps: int, lr: float,
          max_grad_norm: float, bf16: bool = False) -> dict:
    """One run of ``config``: its losses per step, final weights and optimizer-state bytes."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    import memgrad_hf  # noqa: F401  (registers forge_*)
    from memgrad_hf.offline import DEMO_TEXT, build_char_tokenizer, lm_blocks

    hf_logging.set_verbosity_error()
    tok = build_char_tokenizer()
    model = _model(hidden, layers, len(tok))
    if bf16:
        model = model.to(torch.bfloat16)
    data = lm_blocks(tok, DEMO_TEXT, seq, batch * steps)
    start = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = TrainingArguments(output_dir="/tmp/memgrad_bench_forge_drift", max_steps=steps,
                             per_device_train_batch_size=batch, learning_rate=lr, warmup_steps=steps // 10,
                             weight_decay=0.01, max_grad_norm=max_grad_norm, logging_steps=1, save_strategy="no",
                             report_to="none", use_cpu=True, disable_tqdm=True, **{"seed": 0, **CONFIGS[config]})
    t = Trainer(model=model, args=args, train_dataset=data, callbacks=[Losses()])
    t.remove_callback(PrinterCallback)
    t.train()
    opt = getattr(t.optimizer, "optimizer", t.optimizer)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.dim() > 0)
    if hasattr(opt, "detach"):
        opt.detach()
    return {"losses": losses, "start": start, "state_mib": state_bytes / 2**20,
            "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items()}}


def _distance(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).double().square().sum()) for k in a) ** 0.5


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("forge_drift", __doc__, hidden=256, layers=4, seq=64, batch=8, device=False)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true", help="bf16 weights; the reference: its config on fp32 weights")
    p.add_argument("--reference", choices=list(CONFIGS), default="adamw_torch",
                   help="the run the others are measured against (default adamw_torch; forge_lion for Lion's state)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                   help=f"default: {' '.join(DEFAULT)}; with --bf16: {' '.join(DEFAULT_BF16)}")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    kw = dict(hidden=a.hidden, layers=a.layers, seq=a.seq, batch=a.batch, steps=a.steps, lr=a.lr,
              max_grad_norm=a.max_grad_norm)
    configs = a.configs or (DEFAULT_BF16 if a.bf16 else DEFAULT)
    if not a.bf16:  # the reference is the first row
        configs = [a.reference, *(c for c in configs if c != a.reference)]
    print(f"# Trainer, Llama-style hidden {a.hidden} x {a.layers} layers, character vocabulary, {a.steps} steps of "
          f"{a.batch}x{a.seq} tokens, lr {a.lr} (warmup 10%, linear decay), weight decay 0.01, max_grad_norm "
          f"{a.max_grad_norm}, {f'bf16 weights (reference: {a.reference}, fp32 weights)' if a.bf16 else 'fp32 weights'}"
          ", cpu")
    print(f"# {machine('cpu')}; {versions()}\n")
    runs: dict[str, dict] = {}
    if a.bf16:
        configs = ["reference", *configs]
        runs["reference"] = train(a.reference, **kw)
    for c in configs:
        if c in runs:
            continue
        try:
            runs[c] = train(c, bf16=a.bf16, **kw)
        except Exception as e:  # a peer that cannot run here (bitsandbytes absent) is a row, not a crash
            runs[c] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:160]}
    ref = runs[configs[0]]
    if "error" in ref:
        print(f"the reference run failed: {ref['error']}")
        return 1
    marks = sorted({max(1, min(m, a.steps)) for m in (1, a.steps // 10, a.steps // 2, a.steps)})
    moved = _distance(ref["weights"], ref["start"])  # how far the reference moved the weights
    head = " | ".join(f"loss @ {m}" for m in marks)
    print(f"| optimizer | state (MiB) | {head} | mean loss, last 10% | distance from the reference's weights |")
    print("|---|---:|" + "---:|" * len(marks) + "---:|---:|")
    for c in configs:
        r = runs[c]
        if "error" in r:
            print(f"| {c} | — | " + " | " * len(marks) + f" | {r['error']} |")
            continue
        tail = r["losses"][-max(1, a.steps // 10):]
        dist = _distance(r["weights"], ref["weights"])
        rel = f"{dist / moved:.1e} of its move"
        cells = " | ".join(f"{r['losses'][m - 1]:.4f}" for m in marks)
        name = f"{a.reference}, fp32 weights (reference)" if c == "reference" else c
        print(f"| {name} | {r['state_mib']:.2f} | {cells} | {sum(tail) / len(tail):.4f} | {rel} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
