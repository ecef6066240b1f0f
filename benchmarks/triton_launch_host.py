"""Host time of one FORGE kernel launch in Python: Triton's binding (``kernel[grid](...)``) against
:class:`memgrad_hf.kernels.triton_launch.Launcher` (a variant launched before, launched directly).

    python -m benchmarks.triton_launch_host [--calls 2000] [--repeats 9]

Runs on a machine without a GPU: Triton's Python runs for real, while compiling and the C launch (the same in both
paths) are stand-ins (``tests/fake_triton_driver.py``), so the difference is what the launcher saves per launch. Each
row is FORGE's wrapper as a training step calls it (its own Python included): the fused ``linear_weight_step`` (a
2048 x 2048 bf16 layer, 1024 tokens, bf16 AdamW state) and the one-tensor ``update_step`` (``kernel=split``'s
update, the norms' and biases' updates). The two paths are timed alternately in one process.
"""

from __future__ import annotations

import argparse
import sys
import timeit

import torch

from benchmarks.harness import machine, versions
from memgrad_hf.kernels import forge_triton as T
from memgrad_hf.kernels import triton_launch as L


def _calls() -> dict:
    n, out_f, in_f = 1024, 2048, 2048
    bf = torch.bfloat16
    dy, x, w = torch.randn(n, out_f, dtype=bf), torch.randn(n, in_f, dtype=bf), torch.randn(out_f, in_f, dtype=bf)
    st = {"exp_avg": torch.zeros(out_f, in_f, dtype=bf), "exp_avg_sq": torch.zeros(out_f, in_f, dtype=bf)}
    hp = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    sums = (torch.zeros(()), torch.zeros((), dtype=torch.int32))
    return {
        "linear_weight_step (fused dW + AdamW)": lambda: T.linear_weight_step(
            "adamw", dy, x, w, st, hp, 3, stochastic_rounding=True, seed=5, sums=sums),
        "update_step (AdamW)": lambda: T.update_step("adamw", w, w, st, hp, 3, seed=5, sums=sums),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.triton_launch_host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    import triton

    from tests import fake_triton_driver as FD

    FD.install()  # (from here on this process launches nothing for real: a benchmark process of its own)

    print(f"# {machine('cpu')}; {versions()}, triton {triton.__version__}\n# {a.calls} calls per run, {a.repeats} "
          "runs per path, alternating; compiling and the C launch are stand-ins\n")
    print("| FORGE wrapper | Triton's binding, µs per call (min / median) | direct launch | saved per launch |")
    print("|---|---:|---:|---:|")
    for name, call in _calls().items():
        times: dict[str, list[float]] = {"jit": [], "direct": []}
        for _ in range(a.repeats + 1):  # (the first round: warm-up, variants looked up)
            for path in times:
                L.ENABLED = path == "direct"
                times[path].append(timeit.timeit(call, number=a.calls) / a.calls * 1e6)
        (j0, jm), (d0, dm) = ((min(t[1:]), sorted(t[1:])[len(t[1:]) // 2]) for t in times.values())
        print(f"| {name} | {j0:.1f} / {jm:.1f} | {d0:.1f} / {dm:.1f} | {j0 - d0:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
