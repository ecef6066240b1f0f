"""Host cost of one FORGE layer update on a GPU: how long the host spends launching the Triton weight step (and the
optimizer's per-layer bookkeeping) against the device time it buys, next to torch's ``dW = dYᵀX`` + fused AdamW.

    python -m benchmarks.forge_launch [--out 2048 --in 2048 --tokens 1024 --calls 200]

A step of a small batch is host-bound when the host time per layer exceeds the device time per layer. When the
device is the bottleneck the host loop waits for it (host ≈ host + device); a tiny layer (``--out 256 --in 256
--tokens 64``) measures the host cost alone.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _time(fn, calls: int) -> tuple[float, float, float]:
    """(host µs per call: the loop without waiting for the device; device-inclusive µs per call; device µs per call:
    the kernels' own time, from the profiler). A call is host-bound where the first exceeds the third."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    return host / calls * 1e6, total / calls * 1e6, _device_us(fn, min(calls, 20))


def _device_us(fn, calls: int) -> float:
    """Kernel time per call; NaN if the profiler cannot see the device."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        # the kernels' own events (a CPU op's self device time repeats its kernels': not summed twice)
        return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA) / calls
    except Exception:  # a profiler without CUPTI: the other two columns still stand
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    from memgrad_hf.kernels import forge as K
    from memgrad_hf.kernels import forge_triton, triton_launch
    from memgrad_hf.optim.forge import ForgeAdamW

    p = argparse.ArgumentParser(prog="python -m benchmarks.forge_launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=int, default=2048)
    p.add_argument("--in", dest="in_f", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--sweep", action="store_true",
                   help="also time the bf16 kernel under other tile shapes / warps / stages (LINEAR_TILES)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("forge_launch measures a GPU's kernel launches: no CUDA device here (the host side alone: "
              "python -m benchmarks.forge_host).", file=sys.stderr)
        return 2
    dev, bf = "cuda", torch.bfloat16
    dy = torch.randn(a.tokens, a.out, device=dev, dtype=bf)
    x = torch.randn(a.tokens, a.in_f, device=dev, dtype=bf)
    w = torch.nn.Parameter(torch.randn(a.out, a.in_f, device=dev, dtype=bf) * 0.02)
    hp = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    rows: list[tuple[str, float, float, float]] = []
    tile_rows = K.row_tiles(a.out, a.in_f, 64 << 20)  # the optimizer's GPU tile (64 MiB of fp32 dW)
    for kind in (torch.float32, bf):
        st = {"exp_avg": torch.zeros_like(w, dtype=kind), "exp_avg_sq": torch.zeros_like(w, dtype=kind)}
        rows.append((f"Triton linear_weight_step only, {str(kind)[6:]} state", *_time(
            lambda st=st: forge_triton.linear_weight_step("adamw", dy, x, w.data, st, hp, 5), a.calls)))
        # the same through Triton's per-call binding (MEMGRAD_TRITON_LAUNCH=jit), as before triton_launch
        triton_launch.ENABLED, enabled = False, triton_launch.ENABLED
        rows.append(("the same, Triton's binding per call (MEMGRAD_TRITON_LAUNCH=jit)", *_time(
            lambda st=st: forge_triton.linear_weight_step("adamw", dy, x, w.data, st, hp, 5), a.calls)))
        triton_launch.ENABLED = enabled
        # kernel=split: cuBLAS dW row tiles, each then updated by the update kernel
        rows.append((f"split: cuBLAS dW tiles + Triton update, {str(kind)[6:]} state", *_time(
            lambda st=st: forge_triton.linear_weight_step_split("adamw", dy, x, w.data, st, hp, 5,
                                                                rows_per_tile=tile_rows), a.calls)))
    # Lion (one state, no sqrt / division): at 7B its Trainer step was slower than AdamW's with bf16 state (run F)
    lion = {"exp_avg": torch.zeros_like(w)}
    for kernel, fn in (("fused", forge_triton.linear_weight_step), ("split", forge_triton.linear_weight_step_split)):
        rows.append((f"Lion, bf16 state, {kernel} (one tile per layer)", *_time(
            lambda fn=fn: fn("lion", dy, x, w.data, lion, hp, 5, rows_per_tile=a.out), a.calls)))
    if a.sweep:
        q8 = {}
        for name in ("exp_avg", "exp_avg_sq"):
            q8[name], q8[name + ".scale"] = K.quantize_8bit(torch.full_like(w, 1e-3, dtype=torch.float32),
                                                            positive=name == "exp_avg_sq")
        states = {"bf16": {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}, "8-bit": q8}
        tiles = forge_triton.LINEAR_TILES["lowp"]
        default = dict(tiles)
        shapes = ((64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (128, 64, 64, 8, 4), (128, 64, 32, 8, 4),
                  (128, 128, 64, 8, 3), (128, 128, 32, 8, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
                  (128, 128, 64, 16, 3), (256, 64, 32, 8, 3))
        for label, st in states.items():
            for bm, bn, bk, warps, stages in shapes:
                tiles.update(bm=bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages)
                what = f"sweep, {label} state: BM {bm} BN {bn} BK {bk} warps {warps} stages {stages}"
                try:
                    rows.append((what, *_time(
                        lambda st=st: forge_triton.linear_weight_step("adamw", dy, x, w.data, st, hp, 5), a.calls)))
                except Exception as e:  # a shape the GPU cannot hold (shared memory): say so, go on
                    rows.append((f"{what}: {type(e).__name__}", 0, 0, 0))
        tiles.clear()
        tiles.update(default)
        # kernel=split: rows per cuBLAS dW tile (tile_bytes of fp32-equivalent dW; a bf16 tile is half that): a tile
        # small enough to stay in L2 between its GEMM and its update saves the gradient's trip to memory
        for mib in (4, 8, 16, 32, 64):
            r = K.row_tiles(a.out, a.in_f, mib << 20)
            rows.append((f"sweep, split, bf16 state: tile_bytes {mib} MiB ({r} rows)", *_time(
                lambda r=r: forge_triton.linear_weight_step_split("adamw", dy, x, w.data, states["bf16"], hp, 5,
                                                                  rows_per_tile=r), a.calls)))
    lin = torch.nn.Linear(a.in_f, a.out, bias=False, device=dev, dtype=bf)
    opt = ForgeAdamW(lin.parameters(), model=lin, lr=1e-4)
    opt._mode = "apply"
    rows.append(("FORGE layer backward bookkeeping + kernel (bf16 state)", *_time(
        lambda: opt._linear_weight_backward(lin.weight, dy, x), a.calls)))
    ref = torch.nn.Parameter(w.detach().clone())
    m, v = torch.zeros_like(ref), torch.zeros_like(ref)
    steps = torch.tensor(5.0, device=dev)

    def torch_step() -> None:
        g = dy.t() @ x
        torch._fused_adamw_([ref], [g], [m], [v], [], [steps], lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0,
                            eps=1e-8, amsgrad=False, maximize=False)

    rows.append(("torch dW GEMM + fused AdamW (bf16 state)", *_time(torch_step, a.calls)))
    print(f"# one {a.out}x{a.in_f} bf16 weight, {a.tokens} tokens, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}\n")
    print("| what | host µs / call | host + device µs / call | device (kernels) µs / call |\n|---|---:|---:|---:|")
    for name, host, total, device in rows:
        print(f"| {name} | {host:.0f} | {total:.0f} | {device:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
