"""Host cost of one kernel launch on a GPU: Triton kernels (an empty one, and memgrad's own at tiny sizes) against
torch ops (``python -m benchmarks.launch_overhead``; GPU only).

Several measured GPU paths are bound by the host rather than the device: a ~1B FORGE step at batch 1, the Titans
kernel at the issue's shapes (~0.4 ms for ~12 launches of microsecond work), the GRPO head's per-chunk launches.
At these tiny sizes the device time per launch is a few microseconds, so each row's time per call is what the host
spends issuing it: the number that says whether a path should launch fewer Triton kernels, or launch them through
a cheaper path than ``JITFunction.run``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.forge_launch import _time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.launch_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_overhead measures GPU kernel launches; no CUDA device here", file=sys.stderr)
        return 2
    import triton
    import triton.language as tl

    from memgrad_hf.kernels import forge_triton, head_triton, titans_rows_triton
    from memgrad_hf.kernels.head import Epilogue

    @triton.jit
    def _noop(x_ptr):
        pass

    @triton.jit
    def _noop_many(x_ptr, y_ptr, z_ptr, n0, n1, n2, n3, n4, n5, f0, f1, f2, f3, f4, f5, f6, f7, f8,
                   A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr, E: tl.constexpr,
                   F: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
        pass

    dev = "cuda"
    x = torch.zeros(64, device=dev)
    g, c, d = 1, 8, 16
    m, k, v = (torch.randn(g, c, d, device=dev) for _ in range(3))
    lr, gamma = torch.rand(g, c, device=dev), torch.zeros(g, d, device=dev)
    w = torch.randn(32, 64, device=dev, dtype=torch.bfloat16)
    st = {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}
    hp = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    dy, xin = torch.randn(16, 32, device=dev, dtype=torch.bfloat16), torch.randn(16, 64, device=dev,
                                                                                  dtype=torch.bfloat16)
    sums = (torch.zeros((), device=dev), torch.zeros((), dtype=torch.int32, device=dev))
    u = torch.randn(8, 256, device=dev, dtype=torch.bfloat16)
    tgt = torch.randint(0, 256, (8,), device=dev)
    lse = torch.zeros(8, device=dev)
    rows = [
        ("torch: x.add_(1)", lambda: x.add_(1)),
        ("torch: bmm (1 x 8 x 16 @ 16 x 16)", lambda: torch.bmm(m, m.transpose(1, 2))),
        ("Triton: empty kernel, 1 argument", lambda: _noop[(1,)](x)),
        ("Triton: empty kernel, 18 arguments + 8 constexprs", lambda: _noop_many[(1,)](
            x, x, x, 1, 2, 3, 4, 5, 6, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, A=1, B=2, C=3, D=4, E=5, F=6,
            G=7, H=8)),
        ("Titans row kernel: ln_residual", lambda: titans_rows_triton.ln_residual(m, k, gamma)),
        ("Titans row kernel: ln_loss_grad", lambda: titans_rows_triton.ln_loss_grad(m, k, v, lr, gamma)),
        ("FORGE: update_step (bf16 state, 32 x 64)", lambda: forge_triton.update_step(
            "adamw", w, w, st, hp, 5, sums=sums)),
        ("FORGE: linear_weight_step (fused, 32 x 64)", lambda: forge_triton.linear_weight_step(
            "adamw", dy, xin, w, st, hp, 5, sums=sums)),
        ("head: gradient row kernel (8 x 256)", lambda: head_triton._grad_rows(
            u, 0, tgt, lse, [lse, None, None, None], Epilogue.make())),
    ]
    print(f"# host µs per launch at tiny sizes, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}\n")
    print("| what | host µs / call | host + device µs / call | device (kernels) µs / call |\n|---|---:|---:|---:|")
    for name, fn in rows:
        try:
            print("| {} | {:.1f} | {:.1f} | {:.1f} |".format(name, *_time(fn, a.calls)), flush=True)
        except Exception as e:  # one row's failure does not hide the others
            print(f"| {name} | {type(e).__name__}: {e} | | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
