"""Side-by-side benchmark harness.

Peak memory is read per configuration as the peak over what the configuration's inputs already occupy: on CPU in
a *fresh* process (peak RSS is monotonic and allocators keep freed pages); on a GPU, where the caching allocator's
peak counter is exact per run once reset, the kernel benchmarks may read it in this process
(``in_process=True``), after the libraries' one-time workspaces exist, sparing the ~10 s a spawned process costs
per configuration (CUDA, imports) out of a short GPU lease. Time is measured in the parent process with
configurations interleaved round-robin, so the noisy machine slows every peer alike.

A case is ``(name, setup, run)``: ``setup(**kw)`` builds inputs and returns a state, ``run(state)`` does the
measured work. Both must be importable top-level functions (they are pickled by reference for the child).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memgrad_hf import memory


@dataclass
class Case:
    name: str
    setup: Callable[..., Any]
    run: Callable[[Any], Any]
    kwargs: dict = field(default_factory=dict)


FRESH_HELP = ("on a GPU, read each configuration's peak memory in a fresh process (as every run before run G did) "
              "instead of in this one")


def bench_parser(name: str, doc: str | None, *, device: bool = True, **sizes: int) -> argparse.ArgumentParser:
    """The parser of ``memgrad-hf bench <name>``: an int option per model size given (``vocab=32768`` ->
    ``--vocab``, with that default) and ``--device`` (the GPU where there is one)."""
    p = argparse.ArgumentParser(prog=f"memgrad-hf bench {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for size, default in sizes.items():
        p.add_argument(f"--{size}", type=int, default=default)
    if device:
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def _measure(case: Case, device: str, threads: int) -> dict:
    """Set ``case`` up, run it once and return ``{"ok", "added_mib" | "error"}``: its peak over what was in use
    before the run."""
    state = None
    try:
        torch.set_num_threads(threads)
        state = case.setup(device=device, **case.kwargs)
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        base = memory.current_bytes(device)
        memory.reset_peak(device)
        case.run(state)
        peak = memory.peak_bytes(device)
        return {"ok": True, "added_mib": (peak - base) / memory.MiB}
    except Exception as e:  # reported as a row, not a crash of the whole table
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
    finally:
        del state
        gc.collect()


def _child(case: Case, device: str, threads: int, q) -> None:
    if device == "cpu":
        _warm_cpu(threads)
    q.put(_measure(case, device, threads))


def _warm_cpu(threads: int) -> None:
    """Start the OpenMP thread pool and initialise MKL (a few MiB of thread stacks and tables kept for the process's
    life, which a training process has long paid when its head or optimizer runs), so that no configuration is
    charged for them."""
    torch.set_num_threads(threads)
    a = torch.ones(256, 256)
    torch.mm(a, a), torch.addmm(a, a, a), torch.softmax(a, 1), (a * a).sum()


def warm_libraries(device: str) -> None:
    """Create cuBLAS's (and cuBLASLt's) per-stream workspaces, which the caching allocator keeps for the process's
    life: measured in this process, the first configuration would otherwise be charged for them and the rest not."""
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.ones(64, 64, dtype=dt, device=device)
        torch.mm(a, a), torch.addmm(a, a, a), torch.bmm(a[None], a[None]), torch.matmul(a, a.t())
    torch.cuda.synchronize(device)


def peak_added_mib(case: Case, device: str = "cpu", threads: int = 2, timeout: float = 3600,
                   in_process: bool = False) -> dict:
    """Run ``case`` once in a fresh spawned process (or, with ``in_process`` on a GPU, in this one); return
    ``{"ok", "added_mib" | "error"}``."""
    if in_process:
        if not device.startswith("cuda"):
            raise ValueError("in_process peak memory needs a GPU's allocator counters; on CPU each configuration "
                             "runs in a fresh process (peak RSS is monotonic)")
        warm_libraries(device)
        out = _measure(case, device, threads)
        torch.cuda.empty_cache()
        return out
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(case, device, threads, q))
    # glibc serves allocations >= 64 KiB with mmap and returns them on free, so the peak RSS tracks live tensors
    # instead of what the allocator happens to keep cached (read by the child's libc at start-up).
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        p.start()
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    try:
        out = q.get(timeout=timeout)
    except Exception as e:
        p.kill()
        return {"ok": False, "error": f"no result ({type(e).__name__}); exit code {p.exitcode}"}
    p.join()
    return out


def time_interleaved(cases: list[Case], device: str = "cpu", repeats: int = 3, warmup: int = 1,
                     states_out: dict | None = None, lazy: bool = False) -> dict:
    """Seconds per run for each case, measured round-robin in this process: ``{name: (min, median)}``.
    ``states_out``, if given, receives each case's state afterwards (to read results off it). ``lazy``: each run
    sets its case up just before and drops it after (set-up untimed), so only one case's state is alive at a time
    (a 7B model per configuration would not fit on one GPU several times over)."""
    states: dict = {}
    errors = {}

    def make(c: Case) -> None:
        try:
            states[c.name] = c.setup(device=device, **c.kwargs)
        except Exception as e:
            errors[c.name] = f"{type(e).__name__}: {e}"

    if not lazy:
        for c in cases:
            make(c)
    times: dict[str, list[float]] = {c.name: [] for c in cases}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for i in range(warmup + repeats):
        for c in cases:
            if lazy and c.name not in errors:
                make(c)
            if c.name not in states or c.name in errors:
                continue
            try:
                sync()
                t0 = time.perf_counter()
                c.run(states[c.name])
                sync()
                if i >= warmup:
                    times[c.name].append(time.perf_counter() - t0)
            except Exception as e:
                errors[c.name] = f"{type(e).__name__}: {e}"
            finally:
                if lazy:
                    del states[c.name]
                    gc.collect()
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
    if states_out is not None:
        states_out.update(states)
    out = {n: (min(t), statistics.median(t)) for n, t in times.items() if t and n not in errors}
    out.update({n: e for n, e in errors.items()})
    return out


def print_peer_table(cases: list[Case], mem: dict, times: dict, ref: str, ref_label: str, time_unit: str = "s",
                     scale: float = 1.0, digits: int = 2) -> bool:
    """Print peak memory and time side by side, with ratios to the peer ``ref``; return whether every peer ran.
    ``mem``: :func:`peak_added_mib` results, ``times``: :func:`time_interleaved`'s, shown times ``x scale``."""
    ref_m, ref_t = mem.get(ref), times.get(ref)
    print(f"| peer | peak added (MiB) | vs {ref_label} | time min / median ({time_unit}) | vs {ref_label} |\n"
          "|---|---:|---:|---:|---:|")
    ok = True
    for c in cases:
        m, t = mem[c.name], times.get(c.name)
        if not m["ok"] or not isinstance(t, tuple):
            print(f"| {c.name} | — | | {m.get('error') if not m['ok'] else t} | |")
            ok = False
            continue
        rm = f"{m['added_mib'] / ref_m['added_mib']:.2f}x" if ref_m and ref_m["ok"] else ""
        rt = f"{t[1] / ref_t[1]:.2f}x" if isinstance(ref_t, tuple) else ""
        print(f"| {c.name} | {m['added_mib']:.0f} | {rm} | {t[0] * scale:.{digits}f} / {t[1] * scale:.{digits}f} | "
              f"{rt} |", flush=True)
    return ok


def profile_once(case: Case, device: str = "cpu", rows: int = 15) -> str:
    """Run ``case`` once as warm-up, then once under ``torch.profiler``; return a Markdown section with the ops that
    took the most time (device time on a GPU) and the number of host syncs: where a peer's time goes."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    try:
        state = case.setup(device=device, **case.kwargs)
        case.run(state)
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            case.run(state)
            if cuda:
                torch.cuda.synchronize()
    except Exception as e:
        return f"\n### profile: {case.name}\n\nfailed: {type(e).__name__}: {e}\n"
    ev = prof.key_averages()
    table = ev.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=rows)
    return f"\n### profile: {case.name} ({host_waits(ev, cuda)})\n\n```\n{table}\n```\n"


def host_waits(events, cuda: bool) -> str:
    """What in a profile made the host wait. On a GPU: the runtime's synchronizing calls (a device scalar read is
    one of them), not ``aten::_local_scalar_dense`` itself, which also counts reads of CPU tensors (a FORGE step reads
    each parameter's step counter, kept on the CPU as torch.optim keeps it: 147 parameters of a ~1B Llama, most of
    the 158 "syncs" run I's profile counted that way). On CPU: the scalar reads."""
    if cuda:
        n = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
        return f"host syncs: {n}"
    return f"scalar reads: {sum(e.count for e in events if e.key == 'aten::_local_scalar_dense')}"


def versions() -> str:
    import importlib.metadata as md
    import platform

    parts = [f"python {platform.python_version()}"]
    for pkg in ("torch", "transformers", "trl", "triton", "liger-kernel", "bitsandbytes", "memgrad-hf"):
        try:
            parts.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(parts)


def machine(device: str) -> str:
    import os
    import platform

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    return f"{cpu} CPU, {torch.get_num_threads()} threads of {os.cpu_count()} cores"
