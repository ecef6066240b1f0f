"""The Triton FORGE kernel matches its torch twin (run on CPU through the Triton interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernel_matches_torch_twin_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "optim" / "_triton_twin_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "max relative error" in res.stdout


def test_forge_in_trainer_through_triton_kernels_equals_adamw_torch():
    env = dict(os.environ, TRITON_INTERPRET="1", MEMGRAD_BACKEND="triton", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "optim" / "_triton_trainer_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "max relative weight error" in res.stdout


def test_bf16_model_low_precision_state_triton_path_matches_torch_path_in_trainer():
    # gpu_checks' bf16-model check (bf16 and 8-bit state, clipping) run under the interpreter on CPU
    env = dict(os.environ, TRITON_INTERPRET="1", MEMGRAD_CHECK_DEVICE="cpu", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    code = ("import tests.gpu_checks as g; g.check_forge_low_precision_trainer(); "
            "print('FAILED', g.FAILED); raise SystemExit(1 if g.FAILED else 0)")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(ROOT), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("PASS") == 6
