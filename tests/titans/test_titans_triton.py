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
