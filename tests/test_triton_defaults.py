"""How the Triton defaults (head, FORGE) are chosen on a GPU (``kernels.default_backend``) and fall back to the torch
path where Triton cannot run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family", ["head", "forge", "titans"])
def test_triton_defaults_fall_back_to_torch_where_triton_cannot_run(monkeypatch, caplog, family):
    """The default Triton kernels of a family are tried once per process; where they fail to build or run (here: no
    CUDA device at all), one warning says so and the torch path serves every call. A forced MEMGRAD_BACKEND=triton
    is not second-guessed."""
    from memgrad_hf import kernels
    from memgrad_hf.kernels import head, head_triton

    monkeypatch.delenv("MEMGRAD_BACKEND", raising=False)
    monkeypatch.setattr(kernels, "_TRITON_RUNS", {})
    tried = []

    def smoke(kind):
        tried.append(kind)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setitem(kernels.smoke.TESTS, family, smoke)
    with caplog.at_level("WARNING", logger="memgrad_hf.kernels"):
        assert kernels.default_backend(family, "cuda") == "torch"
        assert kernels.default_backend(family, "cuda") == "torch"
        if family == "head":
            assert kernels.head_impl("cuda") is head
    assert tried == ["cuda"]  # once per process
    assert sum("the torch path is used instead" in r.getMessage() for r in caplog.records) == 1
    assert "no kernel image" in caplog.text and f"Triton {family} kernels" in caplog.text
    assert kernels.default_backend(family, "cpu") == "torch" and tried == ["cuda"]  # CPU: torch, nothing to try
    monkeypatch.setenv("MEMGRAD_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.default_backend(family, "cuda") == "triton" and tried == ["cuda"]
    if family == "head":
        assert kernels.head_impl("cuda") is head_triton


@pytest.mark.parametrize("family", ["forge", "titans"])
def test_smoke_test_runs_under_the_interpreter(family):
    # the smoke test itself (what decides whether a GPU gets the family's Triton kernels), on CPU
    code = f"from memgrad_hf import kernels; kernels.smoke.{family}('cpu'); print('smoke passed')"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "smoke passed" in res.stdout, res.stdout + res.stderr
