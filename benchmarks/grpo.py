"""GRPO scoring + loss backward, side by side (``memgrad-hf bench grpo``).

Per-token log-probs and entropies of ``completions x length`` tokens at Qwen2.5's vocabulary (151936, hidden 896),
then a policy-gradient loss ``-(logp · advantage).mean()`` backward. Peers: full logits (``log_softmax`` + gather,
what TRL < 1.15 did), TRL 1.16's fused head (``ChunkedLogProbFunction``; on CPU its torch fallback), memgrad
(``memgrad_hf.functional.linear_logprobs``; its Triton head kernels on GPU) and, on GPU, memgrad on its torch
path (``memgrad_torch``: ``MEMGRAD_BACKEND=torch``). Peak memory per configuration in a fresh process (on a GPU: in
this process, ``--fresh`` for one each); time round-robin.
``--outputs sft`` also asks each fused head for whether the token is the top-1 (what TRL's SFTTrainer scores for its
token accuracy), ``kto`` for the mean logit.
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.harness import (
    FRESH_HELP,
    Case,
    bench_parser,
    machine,
    peak_added_mib,
    print_peer_table,
    profile_once,
    time_interleaved,
    versions,
)

PEERS = ("full_logits", "trl", "memgrad", "memgrad_torch")


EXTRA_OUTPUTS = {"grpo": (), "sft": ("is_top1",), "kto": ("mean_logits",)}  # beyond log-probs and entropy


def setup(device: str, impl: str, n: int, d: int, v: int, dtype: str, outputs: str = "grpo") -> dict:
    if impl == "memgrad_torch" and not device.startswith("cuda"):
        raise RuntimeError("GPU only (on CPU the torch path is memgrad's default)")
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(n, d, generator=g) * 0.5).to(device=device, dtype=dt).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.02).to(device=device, dtype=dt).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g).to(device)
    adv = torch.randn(n, generator=g).to(device)
    return {"h": h, "w": w, "y": y, "adv": adv, "impl": impl, "extra": EXTRA_OUTPUTS[outputs]}


def _logp_entropy(impl: str, h, w, y, extra: tuple[str, ...]):
    if impl == "full_logits":
        logits = (h @ w.t()).float()
        ls = logits.log_softmax(-1)
        return ls.gather(-1, y[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    if impl == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        lp, ent, *_ = ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 32768, None, 1.0, ("entropy", *extra))
        return lp, ent
    from memgrad_hf.functional import linear_logprobs

    return linear_logprobs(h, w, y, return_entropy=True, diagnostics={} if extra else None)


def run(s: dict) -> None:
    s["h"].grad = s["w"].grad = None
    if s["impl"] == "memgrad_torch":  # forward and backward both dispatch on MEMGRAD_BACKEND
        os.environ["MEMGRAD_BACKEND"] = "torch"
    try:
        logp, ent = _logp_entropy(s["impl"], s["h"], s["w"], s["y"], s["extra"])
        loss = -(logp * s["adv"]).mean()
        loss.backward()
    finally:
        if s["impl"] == "memgrad_torch":
            os.environ.pop("MEMGRAD_BACKEND", None)
    float(ent.detach().mean())  # entropy is logged by GRPOTrainer, not differentiated


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("grpo", __doc__, hidden=896, vocab=151936)
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--peers", nargs="+", default=None, choices=PEERS,
                   help="default: all (memgrad_torch, the torch path forced on a GPU, on a GPU only)")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    p.add_argument("--outputs", choices=list(EXTRA_OUTPUTS), default="grpo",
                   help="per-token outputs asked of the fused heads besides log-probs and entropy (sft: top-1)")
    p.add_argument("--profile", action="store_true", help="after the table, profile one run of each peer")
    a = p.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    torch.set_num_threads(a.threads)
    n = a.completions * a.length
    print(f"# GRPO scoring + loss backward: {a.completions} x {a.length} tokens, hidden {a.hidden}, vocab {a.vocab}, "
          f"{dtype}, {a.device}, outputs {a.outputs}\n# {machine(a.device)}; {versions()}\n")
    kw = dict(n=n, d=a.hidden, v=a.vocab, dtype=dtype, outputs=a.outputs)
    peers = a.peers or [p for p in PEERS if p != "memgrad_torch" or a.device.startswith("cuda")]
    cases = [Case(peer, setup, run, dict(impl=peer, **kw)) for peer in peers]
    mem = {c.name: peak_added_mib(c, a.device, a.threads, in_process=a.device.startswith("cuda") and not a.fresh)
           for c in cases}
    times = time_interleaved(cases, a.device, repeats=a.repeats, warmup=1)
    print_peer_table(cases, mem, times, "trl", "TRL", "ms", scale=1e3, digits=1)
    if a.profile:
        print("".join(profile_once(c, a.device) for c in cases if isinstance(times.get(c.name), tuple)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
