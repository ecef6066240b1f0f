"""LM head + cross-entropy, forward and backward, side by side (``memgrad-hf bench head``).

Peers: HF stock (``lm_head`` logits + ``ForCausalLMLoss``), PyTorch's chunked ``F.linear_cross_entropy``
(``LinearCrossEntropyOptions()``), TRL's fused head (``ChunkedLogProbFunction``, the loss as ``-mean(logp)``),
Liger's fused linear cross-entropy (GPU only: on CPU it needs the Triton interpreter, which takes far too long
at these sizes), memgrad (``memgrad_hf.functional.linear_cross_entropy``; its Triton head on GPU) and, on GPU,
memgrad on its torch path (``memgrad_torch``: ``MEMGRAD_BACKEND=torch``) and memgrad with the logits recomputed
in backward (``memgrad_recompute``: ``grad_in_forward=False``; four GEMMs, but each vocabulary block's weight
gradient summed over all tokens at once instead of a ``[V x H]`` fp32 accumulator re-read and re-written per chunk).

Peak memory: one fresh process per configuration (on a GPU: in this process, ``--fresh`` for one each), peak over
what the inputs (hidden, weight, labels) occupy; it includes the gradients every peer must return (dX and dW).
Time: round-robin in this process.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.harness import FRESH_HELP, Case, machine, peak_added_mib, profile_once, time_interleaved, versions

PEERS = ("hf", "torch_lce", "trl", "liger", "memgrad", "memgrad_torch", "memgrad_recompute")


def setup(device: str, impl: str, n: int, d: int, v: int, dtype: str) -> dict:
    if impl == "liger" and not device.startswith("cuda"):
        raise RuntimeError("not run on CPU (Triton kernel; the interpreter is orders of magnitude too slow)")
    if impl == "memgrad_torch" and not device.startswith("cuda"):
        raise RuntimeError("GPU only (on CPU the torch path is memgrad's default)")
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(n, d, generator=g) * 0.5).to(device=device, dtype=dt).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.02).to(device=device, dtype=dt).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g).to(device)
    fn = _impl(impl)
    return {"h": h, "w": w, "y": y, "fn": fn}


def _impl(name: str):
    if name == "hf":
        from transformers.loss.loss_utils import ForCausalLMLoss

        return lambda h, w, y: ForCausalLMLoss(torch.nn.functional.linear(h, w), None, w.shape[0], shift_labels=y)
    if name == "torch_lce":
        opts = torch.nn.LinearCrossEntropyOptions()
        return lambda h, w, y: torch.nn.functional.linear_cross_entropy(h, w, y, options=opts)
    if name == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        return lambda h, w, y: -ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 32768, None, 1.0, ())[0].mean()
    if name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: loss(w, h, y)
    if name == "memgrad":
        from memgrad_hf.functional import linear_cross_entropy

        return lambda h, w, y: linear_cross_entropy(h, w, y)
    if name == "memgrad_recompute":
        from memgrad_hf.functional import linear_cross_entropy

        return lambda h, w, y: linear_cross_entropy(h, w, y, grad_in_forward=False)
    if name == "memgrad_torch":  # the torch path on a GPU (MEMGRAD_BACKEND=torch)
        from memgrad_hf.functional import linear_cross_entropy

        def torch_head(h, w, y):
            os.environ["MEMGRAD_BACKEND"] = "torch"
            try:
                return linear_cross_entropy(h, w, y)
            finally:
                os.environ.pop("MEMGRAD_BACKEND", None)

        return torch_head
    raise ValueError(f"unknown peer {name!r}; choose from {PEERS}")


def run(s: dict) -> float:
    s["h"].grad = s["w"].grad = None
    loss = s["fn"](s["h"], s["w"], s["y"])
    loss.backward()
    return float(loss.detach())


def _ratio(m: dict, ref: dict | None) -> str:
    return f"{m['added_mib'] / ref['added_mib']:.2f}x" if ref and ref["ok"] and ref["added_mib"] > 0 else ""


def _tratio(t: tuple, ref: object) -> str:
    return f"{t[1] / ref[1]:.2f}x" if isinstance(ref, tuple) else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memgrad-hf bench head", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 128256])
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    p.add_argument("--profile", action="store_true", help="after each vocabulary's table rows, profile one run of "
                   "each peer: the ops that take the most (device) time, and host syncs")
    a = p.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    torch.set_num_threads(a.threads)
    print(f"# LM head + CE forward+backward, {a.tokens} tokens, hidden {a.hidden}, {dtype}, {a.device}")
    print(f"# {machine(a.device)}; {versions()}\n")
    refs = ("torch_lce", "liger")  # the chunked peers (torch_lce needs torch >= 2.13; liger needs a GPU)
    print("| vocab | peer | peak added (MiB) | vs torch_lce | vs liger | vs hf | time min / median (ms) "
          "| time vs torch_lce | time vs liger |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for v in a.vocab:
        cases = [Case(peer, setup, run, dict(impl=peer, n=a.tokens, d=a.hidden, v=v, dtype=dtype)) for peer in a.peers]
        mem = {c.name: peak_added_mib(c, a.device, a.threads, in_process=a.device.startswith("cuda") and not a.fresh)
               for c in cases}
        times = time_interleaved(cases, a.device, repeats=a.repeats, warmup=1)
        for c in cases:
            m, t = mem[c.name], times.get(c.name)
            if not m["ok"] or not isinstance(t, tuple):
                why = m.get("error") if not m["ok"] else t
                print(f"| {v} | {c.name} | — | | | | {why} | | |")
                continue
            mr = " | ".join(_ratio(m, mem.get(r)) for r in (*refs, "hf"))
            tr = " | ".join(_tratio(t, times.get(r)) for r in refs)
            print(f"| {v} | {c.name} | {m['added_mib']:.0f} | {mr} | {t[0] * 1e3:.1f} / {t[1] * 1e3:.1f} | {tr} |",
                  flush=True)
        if a.profile:
            print("".join(profile_once(c, a.device) for c in cases if isinstance(times.get(c.name), tuple)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
