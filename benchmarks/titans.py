"""Titans neural memory, side by side (``memgrad-hf bench titans``).

Two tables.

Kernel: one chunk's inner gradient plus retrieval for ``B`` independent memories (per-memory weights
``(B, D, H)``, ``(B, H, D)``, depth-2 GELU MLP with LayerNorm + residual): the manual kernel
(``memgrad_hf.kernels.titans.memory_step``) against the ``torch.func.vmap(grad(...))`` reference
(``memory_step_autograd``). On CUDA ``manual`` is the GPU default (cuBLAS GEMMs, the row ops in two Triton kernels,
``kernels.titans_rows_triton``; since 2026-11-27 an inference step at ``D <= 64``, ``H <= 256`` runs as the
whole-step Triton kernel, so ``manual`` and ``triton`` are the same code in those ``fwd`` rows), and two more peers
run: ``manual_torch_rows`` (the same step with its row ops as ~11
torch ops, as before those kernels) and ``triton`` (the opt-in whole-step Triton twin
``kernels.titans_triton.memory_step``, Triton forward, torch-twin backward). ``train``: the kernel forward plus the
outer backward of a random projection of its outputs (second-order terms to weights, gamma, keys, values, queries and
lr); ``fwd``: the kernel alone under ``torch.no_grad()`` (inference). Every kernel is called as ``NeuralMemory`` calls
it: ``return_loss=False`` (the per-token loss, which the layer does not use, is not returned; the reference computes
it in any case).

Layer: store + retrieve over a whole sequence, forward + backward of a random projection of the retrieved output,
to every input and parameter. Peers: ``memgrad_hf.titans.NeuralMemory`` (manual kernel; and ``grad_impl="autograd"``,
the same layer with ``vmap(grad)``) and titans-pytorch's ``NeuralMemory`` configured as closely as it allows:
same width, heads, head width and chunk size, its default depth-2 ``MemoryMLP`` (expansion 4, GELU) with LayerNorm +
residual, momentum on, decay on (always on there), ``qk_rmsnorm=True``, ``per_head_learned_parameters=False``
(ours shares the initial memory across heads), ``default_step_transform_max_lr`` = our ``max_lr`` (0.1) and
``batch_size=None``. The two differ in what "store" means: titans-pytorch takes every chunk's gradient at the
call's start weights (one big ``vmap``), ours takes chunk n's gradient at the weights after chunk n-1 (the Titans
chunk recurrence; segment-invariant). titans-pytorch also has a per-head retrieval gate and learned q/k norm gains.

Peak memory: one fresh process per configuration (on a GPU: in this process, ``--fresh`` for one each), the peak
over what its inputs and module occupy (gradients included). Time: configurations interleaved round-robin in this
process (min / median).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys

import torch

from benchmarks.harness import FRESH_HELP, Case, machine, peak_added_mib, time_interleaved, versions

KERNELS = ("manual", "autograd")
GPU_KERNELS = ("triton", "manual_torch_rows", *KERNELS)
LAYERS = ("titans_pytorch", "memgrad", "memgrad_autograd")


# -- kernel ----------------------------------------------------------------------------------------------------------
def kernel_setup(device: str, impl: str, mode: str, b: int, c: int, d: int, h: int, inner: int = 1) -> dict:
    from memgrad_hf.kernels import titans as K

    if impl == "triton":
        from memgrad_hf.kernels import titans_triton as T

    g = torch.Generator().manual_seed(0)
    train = mode == "train"

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device).requires_grad_(train)

    s = {
        "ws": [t(b, d, h, scale=d ** -0.5), t(b, h, d, scale=h ** -0.5)],
        "gamma": t(b, d, scale=0.1),
        "k": t(b, c, d), "v": t(b, c, d), "q": t(b, c, d),
        "lr": (torch.rand(b, c, generator=g) * 0.1).to(device).requires_grad_(train),
        "step": {"manual": K.memory_step, "autograd": K.memory_step_autograd,
                 "manual_torch_rows": K.memory_step}.get(impl) or T.memory_step,
        "torch_rows": impl == "manual_torch_rows",
        "train": train,
        "inner": inner,
    }
    if train:  # fixed random projections of the outputs (grads, dgamma, retrieved) for the outer backward
        s["probes"] = [torch.randn(x.shape, generator=g).to(device) for x in (*s["ws"], s["gamma"], s["q"])]
    _warm(kernel_run, s, [*s["ws"], s["gamma"], s["k"], s["v"], s["q"], s["lr"]])
    return s


@contextlib.contextmanager
def _torch_rows():
    """The manual step with its row ops in torch on any device, forward and backward (the peer
    ``manual_torch_rows``: what the row kernels replace on a GPU)."""
    from memgrad_hf.kernels import titans as K

    rows_impl, K._rows_impl = K._rows_impl, lambda x: K
    try:
        yield
    finally:
        K._rows_impl = rows_impl


def _warm(run, s: dict, leaves: list[torch.Tensor]) -> None:
    # One untimed run first: the measured run then shows steady-state memory, not one-time costs (lazily paged-in
    # library code, thread pools, functorch set-up) that every peer pays once per process.
    run(s)
    for x in leaves:
        x.grad = None


def kernel_run(s: dict) -> None:
    # ``inner`` calls per timed run: one GPU call is ~0.1 ms, below what a host timer around it resolves well.
    for _ in range(s["inner"]):
        _kernel_once(s)


def _kernel_once(s: dict) -> None:
    with _torch_rows() if s["torch_rows"] else contextlib.nullcontext():
        _kernel_call(s)


def _kernel_call(s: dict) -> None:
    args = (s["ws"], s["gamma"], s["k"], s["v"], s["lr"], s["q"], "gelu")
    if not s["train"]:
        with torch.no_grad():
            s["step"](*args, return_loss=False)
        return
    for x in (*s["ws"], s["gamma"], s["k"], s["v"], s["q"], s["lr"]):
        x.grad = None
    grads, dgamma, retrieved, _ = s["step"](*args, return_loss=False)
    outer = sum((o * p).sum() for o, p in zip((*grads, dgamma, retrieved), s["probes"], strict=True))
    outer.backward()


# -- layer -----------------------------------------------------------------------------------------------------------
def layer_setup(device: str, impl: str, mode: str, batch: int, seq: int, dim: int, heads: int, dim_head: int,
                chunk: int, max_lr: float) -> dict:
    torch.manual_seed(0)
    if impl == "titans_pytorch":
        import titans_pytorch

        mod = titans_pytorch.NeuralMemory(dim, chunk_size=chunk, heads=heads, dim_head=dim_head, momentum=True,
                                          qk_rmsnorm=True, per_head_learned_parameters=False,
                                          default_step_transform_max_lr=max_lr,
                                          default_model_kwargs=dict(depth=2, expansion_factor=4.0))
    else:
        from memgrad_hf.titans import NeuralMemory

        mod = NeuralMemory(dim, heads=heads, dim_head=dim_head, depth=2, expansion=4, chunk_size=chunk,
                           momentum=True, forget=True, max_lr=max_lr,
                           grad_impl="autograd" if impl == "memgrad_autograd" else "manual")
    mod = mod.to(device)
    g = torch.Generator().manual_seed(1)
    train = mode == "train"
    x = torch.randn(batch, seq, dim, generator=g).to(device).requires_grad_(train)
    probe = torch.randn(batch, seq, dim, generator=g).to(device)
    s = {"mod": mod, "x": x, "probe": probe, "train": train}
    _warm(layer_run, s, [x, *mod.parameters()])
    return s


def layer_run(s: dict) -> None:
    mod, x = s["mod"], s["x"]
    if not s["train"]:
        with torch.no_grad():
            mod(x)
        return
    x.grad = None
    for p in mod.parameters():
        p.grad = None
    y = mod(x)[0]
    (y * s["probe"]).sum().backward()


# -- report ----------------------------------------------------------------------------------------------------------
def _rows(cases: list[Case], ref: str, label: str, device: str, threads: int, repeats: int,
          in_process: bool = False) -> list[str]:
    mem = {c.name: peak_added_mib(c, device, threads, in_process=in_process) for c in cases}
    times = time_interleaved(cases, device, repeats=repeats, warmup=1)
    rm, rt = mem.get(ref), times.get(ref)
    out = []
    for c in cases:
        m, t = mem[c.name], times.get(c.name)
        impl = c.kwargs["impl"]
        if not m["ok"] or not isinstance(t, tuple):
            out.append(f"| {label} | {impl} | — | | {m.get('error') if not m['ok'] else t} | |")
        else:
            mr = f"{m['added_mib'] / rm['added_mib']:.2f}x" if rm and rm["ok"] and rm["added_mib"] > 0 else ""
            tr = f"{t[0] / rt[0]:.2f}x / {t[1] / rt[1]:.2f}x" if isinstance(rt, tuple) else ""
            per = 1e3 / c.kwargs.get("inner", 1)  # ms per call
            out.append(f"| {label} | {impl} | {m['added_mib']:.1f} | {mr} | {t[0] * per:.2f} / {t[1] * per:.2f} | "
                       f"{tr} |")
        print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memgrad-hf bench titans", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel-shapes", nargs="*", default=["48x128x64x256", "8x128x64x256", "8x128x128x512",
                                                          "8x128x256x1024"],
                   help="BxCxDxH (memories x chunk x head width x hidden width); none to skip")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim-head", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--max-lr", type=float, default=0.1)
    p.add_argument("--modes", nargs="+", default=["train", "fwd"], choices=["train", "fwd"])
    p.add_argument("--layers", nargs="*", default=list(LAYERS), choices=LAYERS, help="layer peers; none to skip")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--inner", type=int, default=None, help="kernel calls per timed run (default 1 on CPU, 20 on GPU)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    gpu = a.device.startswith("cuda")
    inner = a.inner or (20 if gpu else 1)
    here = gpu and not a.fresh  # GPU peak memory in this process
    import importlib.metadata as md

    try:
        tp_version = f", titans-pytorch {md.version('titans-pytorch')}"
    except md.PackageNotFoundError:
        tp_version = ""
    print(f"# Titans memory, fp32, {a.device}; {machine(a.device)}; {versions()}{tp_version}\n")
    if a.kernel_shapes:
        print("## Kernel: one chunk, inner gradient + retrieval, depth-2 GELU MLP, per-memory weights\n")
        print("| BxCxDxH / mode | kernel | peak added (MiB) | vs vmap(grad) | time per call min / median (ms) "
              "| vs vmap(grad) (min / median) |")
        print("|---|---|---:|---:|---:|---:|")
        for shape in a.kernel_shapes:
            b, c, d, h = (int(v) for v in shape.split("x"))
            for mode in a.modes:
                cases = [Case(f"{shape}/{mode}/{k}", kernel_setup, kernel_run,
                              dict(impl=k, mode=mode, b=b, c=c, d=d, h=h, inner=inner))
                         for k in (GPU_KERNELS if gpu else KERNELS)]
                _rows(cases, f"{shape}/{mode}/autograd", f"{shape} / {mode}", a.device, a.threads,
                      a.repeats, here)
        print()
    layers = list(a.layers)
    if "titans_pytorch" in layers and importlib.util.find_spec("titans_pytorch") is None:
        layers.remove("titans_pytorch")  # the peer is optional: its rows, and the ratios to it, left out (said so)
        print("(titans_pytorch is not installed, so its rows and the ratios to it are left out: pip install "
              "titans-pytorch)\n")
    if layers:
        print(f"## Layer: batch {a.batch}, seq {a.seq}, dim {a.dim}, {a.heads} heads x {a.dim_head}, chunk {a.chunk}; "
              "train = forward + backward of a random projection of the output\n")
        print("| mode | layer | peak added (MiB) | vs titans-pytorch | time min / median (ms) "
              "| vs titans-pytorch (min / median) |")
        print("|---|---|---:|---:|---:|---:|")
        kw = dict(batch=a.batch, seq=a.seq, dim=a.dim, heads=a.heads, dim_head=a.dim_head, chunk=a.chunk,
                  max_lr=a.max_lr)
        for mode in a.modes:
            cases = [Case(f"{mode}/{impl}", layer_setup, layer_run, dict(impl=impl, mode=mode, **kw))
                     for impl in layers]
            _rows(cases, f"{mode}/titans_pytorch", mode, a.device, a.threads, a.repeats, here)
    return 0


if __name__ == "__main__":
    sys.exit(main())
