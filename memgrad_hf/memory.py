"""Process and device peak-memory readings shared by callbacks, the demo and the benchmarks.

On CPU the peak resident set (``VmHWM``) is reset by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0),
so a peak can be read per phase; on CUDA the caching allocator's peak counters are used.
"""

from __future__ import annotations

import torch

MiB = 1024.0 * 1024.0


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Current resident set size of this process, or ``None`` where ``/proc`` is unavailable."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def hwm_bytes() -> int | None:
    """Peak resident set size of this process since the last :func:`reset_peak`."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak(device: torch.device | str | None = None) -> None:
    """Reset the peak counter: CUDA allocator stats for a CUDA device, ``VmHWM`` otherwise."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def current_bytes(device: torch.device | str | None = None) -> int | None:
    """Memory in use now: ``torch.cuda.memory_allocated`` on a GPU, the process's resident set on CPU (None where
    it cannot be read)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return torch.cuda.memory_allocated(dev)
    return rss_bytes()


def peak_bytes(device: torch.device | str | None = None) -> int | None:
    """Peak memory since the last reset: ``torch.cuda.max_memory_allocated`` on a GPU, VmHWM on CPU (None where it
    cannot be read)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev)
    return hwm_bytes()
