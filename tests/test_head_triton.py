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
    monkeypatch.setattr(kernels, "_HEAD_TRITON_RUNS", {"cuda": True})  # as on a GPU where the smoke test passed
    # the Triton head on CUDA (measured faster there), the torch path elsewhere
    assert kernels.head_impl("cpu") is head and kernels.head_impl("cuda") is head_triton
    monkeypatch.setenv("MEMGRAD_BACKEND", "torch")
    assert kernels.head_impl("cuda") is head
    monkeypatch.setenv("MEMGRAD_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.head_impl("cpu") is head_triton and kernels.head_impl("cuda") is head_triton


def test_head_falls_back_to_torch_where_triton_cannot_run(monkeypatch, caplog):
    """The default Triton head is tried once per process; where it fails to build or run (here: no CUDA device at
    all), one warning says so and the torch path serves every call. A forced MEMGRAD_BACKEND=triton is not
    second-guessed."""
    from memgrad_hf import kernels
    from memgrad_hf.kernels import head

    monkeypatch.delenv("MEMGRAD_BACKEND", raising=False)
    monkeypatch.setattr(kernels, "_HEAD_TRITON_RUNS", {})
    tried = []
    real = kernels._smoke_head_triton

    def smoke(kind):
        tried.append(kind)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(kernels, "_smoke_head_triton", smoke)
    with caplog.at_level("WARNING", logger="memgrad_hf.kernels"):
        assert kernels.head_impl("cuda") is head and kernels.head_impl("cuda") is head
    assert tried == ["cuda"]  # once per process
    assert sum("torch head path is used instead" in r.getMessage() for r in caplog.records) == 1
    assert "no kernel image" in caplog.text
    monkeypatch.setenv("MEMGRAD_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from memgrad_hf.kernels import head_triton

    assert kernels.head_impl("cuda") is head_triton and tried == ["cuda"]
    assert real is not smoke
