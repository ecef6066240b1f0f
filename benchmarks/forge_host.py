"""Host time FORGE adds per linear layer and training step: its Python (forward, backward, the optimizer's
bookkeeping) against ``nn.Linear`` + torch's AdamW, with FORGE's update kernels replaced by no-ops.

    python -m benchmarks.forge_host [--device cpu|cuda] [--layers 64] [--width 8] [--steps 20] [--repeats 15]

A ~1B model's step at batch 1 is bound by the host on a GPU (an H100 ran ``adamw_torch_fused``'s step in 66 ms for
27 ms of device time), so what FORGE's Python costs per layer decides its step time there. Each configuration trains
a stack of ``--layers`` tiny linear layers (their compute is negligible), so a step's time per layer is the host's
cost per layer. FORGE's update kernels (the Triton kernels on a GPU, their torch twins on CPU) are no-ops here: what
remains is the Python around them; one Triton launch each is measured by ``benchmarks.launch_overhead`` (GPU).
Exact clipping (``+clip``) runs for real: its norm pass and the replay's bookkeeping are part of the cost.
``+compile`` runs the model under ``torch.compile`` (inductor; the first, compiling, runs are warm-up).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
from torch import Tensor, nn

from benchmarks.harness import Case, machine, time_interleaved, versions

_PEERS = {  # name: (optimizer, max_grad_norm, torch.compile)
    "adamw_torch_fused": ("adamw_torch_fused", 0.0, False),
    "adamw_torch_fused+clip": ("adamw_torch_fused", 1.0, False),
    "forge_adamw": ("forge_adamw", 0.0, False),
    "forge_adamw+clip": ("forge_adamw", 1.0, False),
    # the model under torch.compile (inductor): FORGE's layers are custom operators there (memgrad_hf.optim.forge_ops)
    "adamw_torch_fused+compile": ("adamw_torch_fused", 0.0, True),
    "forge_adamw+compile": ("forge_adamw", 0.0, True),
    "adamw_torch_fused+clip+compile": ("adamw_torch_fused", 1.0, True),
    "forge_adamw+clip+compile": ("forge_adamw", 1.0, True),
}


def _no_update(*args, sums=None, **kwargs):
    """An update kernel that does nothing (same return contract: this step's (Σ g², skipped tiles) accumulators)."""
    if sums is not None:
        return sums
    dev = args[3].device  # the weight (linear steps) or the gradient (update steps): either is on the device
    return torch.zeros((), device=dev), torch.zeros((), dtype=torch.int32, device=dev)


@contextlib.contextmanager
def _update_kernels_stubbed():
    """FORGE's update kernels (torch twins; Triton ones where CUDA is) as no-ops, restored on exit."""
    from memgrad_hf.kernels import forge as K

    swapped = [(K, name) for name in ("linear_weight_step", "update_step")]
    if torch.cuda.is_available():
        from memgrad_hf.kernels import forge_triton

        swapped += [(forge_triton, n) for n in ("linear_weight_step", "linear_weight_step_split", "update_step",
                                                 "update_many")]
    saved = [getattr(mod, name) for mod, name in swapped]
    try:
        for mod, name in swapped:
            setattr(mod, name, _no_update)
        yield
    finally:
        for (mod, name), fn in zip(swapped, saved, strict=True):
            setattr(mod, name, fn)


def _setup(device: str, optim: str, max_grad_norm: float, compile: bool, layers: int, width: int, steps: int) -> dict:
    from memgrad_hf.optim import ForgeAdamW

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    if optim == "forge_adamw":
        opt = ForgeAdamW(model.parameters(), model=model, lr=1e-4, max_grad_norm=max_grad_norm)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(2, width, device=device)
    forge = optim == "forge_adamw"
    # a loss computed outside the model reaches FORGE's exact clipping through opt.backward (the Trainer's hook)
    return dict(model=torch.compile(model) if compile else model, opt=opt, x=x,
                backward=opt.backward if forge else Tensor.backward, clip=0.0 if forge else max_grad_norm, steps=steps)


def _run(s: dict) -> None:
    model, opt, x = s["model"], s["opt"], s["x"]
    for _ in range(s["steps"]):
        loss = model(x).square().mean()
        s["backward"](loss)
        if s["clip"]:  # what the Trainer does for torch.optim (FORGE clips inside backward)
            torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip"])
        opt.step()
        opt.zero_grad()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.forge_host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="training steps per timed run")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--configs", nargs="+", choices=list(_PEERS), default=list(_PEERS))
    a = p.parse_args(argv)
    cases = [Case(name, _setup, _run, dict(optim=o, max_grad_norm=c, compile=comp, layers=a.layers, width=a.width,
                                           steps=a.steps))
             for name, (o, c, comp) in _PEERS.items() if name in a.configs]
    with _update_kernels_stubbed():
        res = time_interleaved(cases, device=a.device, repeats=a.repeats, warmup=2)
    per = a.layers * a.steps / 1e6  # seconds per run -> µs per layer and step
    print(f"# {machine(a.device)}; {versions()}\n# {a.layers} linear layers {a.width}x{a.width}, {a.steps} steps per "
          f"run, {a.repeats} runs; FORGE's update kernels are no-ops\n")
    print("| configuration | µs per layer and step (min / median) | added over its torch peer (min) |")
    print("|---|---:|---:|")
    for name in a.configs:
        r = res.get(name)
        if not isinstance(r, tuple):
            print(f"| {name} | failed: {r} | |")
            continue
        peer = res.get(name.replace("forge_adamw", "adamw_torch_fused"))
        added = f"{(r[0] - peer[0]) / per:+.1f}" if isinstance(peer, tuple) and peer is not r else ""
        print(f"| {name} | {r[0] / per:.1f} / {r[1] / per:.1f} | {added} |")
    return 0 if all(isinstance(res.get(n), tuple) for n in a.configs) else 1


if __name__ == "__main__":
    sys.exit(main())
