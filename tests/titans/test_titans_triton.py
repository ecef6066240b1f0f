"""The Triton Titans memory step matches its torch twin (run on CPU through the Triton interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memgrad_hf import kernels

ROOT = Path(__file__).resolve().parents[2]


def test_triton_memory_step_matches_torch_twin_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "titans" / "_triton_twin_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "max relative error" in res.stdout


def test_titans_step_impl_dispatch(monkeypatch):
    from memgrad_hf.kernels import titans

    monkeypatch.delenv("MEMGRAD_BACKEND", raising=False)
    assert kernels.titans_step_impl("cpu") is titans.memory_step
    assert kernels.titans_step_impl("cuda") is titans.memory_step  # the faster one on an H100 (RESULTS.md)
    monkeypatch.setenv("MEMGRAD_BACKEND", "torch")
    assert kernels.titans_step_impl("cuda") is titans.memory_step
    pytest.importorskip("triton")
    from memgrad_hf.kernels import titans_triton

    monkeypatch.setenv("MEMGRAD_BACKEND", "triton")
    assert kernels.titans_step_impl("cpu") is titans_triton.memory_step


def test_triton_memory_step_rejects_what_it_cannot_take():
    pytest.importorskip("triton")
    import torch

    from memgrad_hf.kernels import titans_triton

    k = torch.zeros(2, 4, 8)
    lr = torch.zeros(2, 4)
    w = [torch.zeros(8, 8)]
    with pytest.raises(ValueError, match="depth"):
        titans_triton.memory_step(w * 5, torch.zeros(8), k, k, lr)
    with pytest.raises(ValueError, match="activation"):
        titans_triton.memory_step(w, torch.zeros(8), k, k, lr, activation="relu")
    with pytest.raises(ValueError, match="last weight"):
        titans_triton.memory_step([torch.zeros(8, 16)], torch.zeros(8), k, k, lr)
    with pytest.raises(ValueError, match="D=512"):
        big = torch.zeros(1, 2, 512)
        titans_triton.memory_step([torch.zeros(512, 512)], torch.zeros(512), big, big, torch.zeros(1, 2))


def test_titans_row_kernels_dispatch(monkeypatch):
    """The torch step's row ops: the Triton kernels on a GPU once the smoke test passed, torch on CPU, under
    ``MEMGRAD_BACKEND=torch``, for non-fp32 tensors and while ``torch.compile`` traces."""
    pytest.importorskip("triton")
    import types

    import torch

    from memgrad_hf.kernels import titans, titans_rows_triton

    monkeypatch.delenv("MEMGRAD_BACKEND", raising=False)
    assert titans._rows_impl(torch.zeros(1)) is titans
    gpu = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)  # only device and dtype are read
    monkeypatch.setitem(kernels._TRITON_RUNS, ("titans", "cuda"), True)  # as after a passing smoke test
    assert titans._rows_impl(gpu) is titans_rows_triton
    assert titans._rows_impl(types.SimpleNamespace(device=gpu.device, dtype=torch.bfloat16)) is titans
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert titans._rows_impl(gpu) is titans
    monkeypatch.undo()
    monkeypatch.setenv("MEMGRAD_BACKEND", "torch")
    assert titans._rows_impl(gpu) is titans
    monkeypatch.setitem(kernels._TRITON_RUNS, ("titans", "cuda"), False)  # the smoke test failed on this GPU
    monkeypatch.delenv("MEMGRAD_BACKEND")
    assert titans._rows_impl(gpu) is titans


def test_titans_inference_step_dispatch(monkeypatch):
    """An inference step takes the whole-step Triton kernel only where it measured faster on an H100: row kernels
    running (a GPU), fp32, depth <= 4, head width <= 64, MLP widths <= 256, something to compute."""
    pytest.importorskip("triton")
    import torch

    from memgrad_hf.kernels import titans, titans_rows_triton, titans_triton

    def inputs(d=64, h=256, depth=2, c=8, cq=4, dtype=torch.float32):
        widths = [d] + [h] * (depth - 1) + [d]
        ws = [torch.zeros(2, widths[i], widths[i + 1], dtype=dtype) for i in range(depth)]
        z = torch.zeros
        return ws, z(2, d), z(2, c, d), z(2, c, d), z(2, c), z(2, cq, d)

    assert titans._inference_step(*inputs()) is None  # CPU: the torch step
    monkeypatch.setattr(titans, "_rows_impl", lambda x: titans_rows_triton)  # as on a GPU whose row kernels run
    assert titans._inference_step(*inputs()) is titans_triton.memory_step
    assert titans._inference_step(*inputs(d=16, h=48, depth=4)) is titans_triton.memory_step
    ws, gamma, k, v, lr, _ = inputs()
    assert titans._inference_step(ws, gamma, k, v, lr, None) is titans_triton.memory_step  # store only
    assert titans._inference_step(*inputs(d=128, h=256)) is None
    assert titans._inference_step(*inputs(d=64, h=512)) is None
    assert titans._inference_step(*inputs(depth=5, h=64)) is None
    assert titans._inference_step(*inputs(dtype=torch.bfloat16)) is None
    assert titans._inference_step(*inputs(c=0)) is None
    assert titans._inference_step(*inputs(cq=0)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert titans._inference_step(*inputs()) is None


def test_titans_row_kernels_reject_what_they_cannot_take():
    pytest.importorskip("triton")
    import torch

    from memgrad_hf.kernels import titans_rows_triton

    x = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="fp32"):
        titans_rows_triton.ln_residual(x.double(), x, torch.zeros(8))
    big = torch.zeros(1, 1, 9000)
    with pytest.raises(ValueError, match="D=9000"):
        titans_rows_triton.ln_residual(big, big, torch.zeros(9000))
