"""Peak memory of the LM head + cross-entropy (forward and backward) as the tokens per step grow, side by side, and a
plot of it (``memgrad-hf bench head_memory``).

    python -m benchmarks.head_memory [--tokens 1024 2048 4096 8192 16384] [--vocab 32768] [--hidden 1024]
                                     [--peers hf torch_lce trl memgrad] [--png benchmarks/head_memory.png]

Same peers and method as ``benchmarks.head`` (one fresh process per configuration; peak over what the inputs
occupy, the returned gradients included), memory only: no timing, so it can run beside other work. The table goes to
stdout; with matplotlib installed (``pip install matplotlib``) and ``--png``, the plot goes to that file.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.harness import Case, machine, peak_added_mib, versions
from benchmarks.head import PEERS, run, setup

_LABELS = {"hf": "HF stock (full logits)", "torch_lce": "torch F.linear_cross_entropy", "trl": "TRL fused head",
           "memgrad": "memgrad"}


def plot(tokens: list[int], rows: dict[str, list[float | None]], title: str, path: str) -> bool:
    """Peak MiB against tokens per peer, to ``path``; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for peer, mib in rows.items():
        pts = [(t, m) for t, m in zip(tokens, mib, strict=True) if m is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=_LABELS.get(peer, peer),
                    linewidth=2.5 if peer == "memgrad" else 1.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("peak memory added (MiB)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memgrad-hf bench head_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--peers", nargs="+", default=["hf", "torch_lce", "trl", "memgrad"], choices=PEERS)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--png", default=None, help="write the plot to this file (needs matplotlib)")
    a = p.parse_args(argv)
    title = f"LM head + CE, forward + backward: vocab {a.vocab}, hidden {a.hidden}, {a.dtype}, CPU"
    print(f"# {title}\n# {machine('cpu')}; {versions()}\n")
    print("| tokens | " + " | ".join(a.peers) + " |")
    print("|---:|" + "---:|" * len(a.peers))
    rows: dict[str, list[float | None]] = {peer: [] for peer in a.peers}
    for n in a.tokens:
        cells = []
        for peer in a.peers:
            m = peak_added_mib(Case(peer, setup, run, dict(impl=peer, n=n, d=a.hidden, v=a.vocab, dtype=a.dtype)),
                               "cpu", a.threads)
            rows[peer].append(m["added_mib"] if m["ok"] else None)
            cells.append(f"{m['added_mib']:.0f} MiB" if m["ok"] else f"— ({m['error'][:60]})")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    if a.png:
        wrote = plot(a.tokens, rows, title, a.png)
        print(f"\nplot: {a.png}" if wrote else "\nno plot: matplotlib is not installed (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(2)
    sys.exit(main())
