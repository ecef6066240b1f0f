"""The Triton head kernel (kernels/head_triton.py) against its torch twin, under the Triton interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_triton_fused_cross_entropy_matches_torch_twin_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("MEMGRAD_BACKEND", None)
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "_head_triton_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "MEMGRAD_BACKEND=triton vs torch" in res.stdout and "max relative error" in res.stdout
    assert "default-head smoke test: passed" in res.stdout


def test_head_backend_dispatch(monkeypatch):
    from memgrad_hf import kernels
    from memgrad_hf.kernels import head, head_triton

    monkeypatch.delenv("MEMGRAD_BACKEND", raising=False)
    monkeypatch.setattr(kernels, "_TRITON_RUNS", {("head", "cuda"): True})  # as on a GPU where the smoke test passed
    # the Triton head on CUDA (measured faster there), the torch path elsewhere
    assert kernels.head_impl("cpu") is head and kernels.head_impl("cuda") is head_triton
    monkeypatch.setenv("MEMGRAD_BACKEND", "torch")
    assert kernels.head_impl("cuda") is head
    monkeypatch.setenv("MEMGRAD_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.head_impl("cpu") is head_triton and kernels.head_impl("cuda") is head_triton
