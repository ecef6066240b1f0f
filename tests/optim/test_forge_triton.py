"""The Triton FORGE kernel matches its torch twin (run on CPU through the Triton interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_interpreted(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root with the Triton interpreter on (and ``env`` added)."""
    full_env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, *args], env=full_env, cwd=str(ROOT), capture_output=True, text=True,
                          timeout=600)


def test_triton_kernel_matches_torch_twin_under_interpreter():
    res = _run_interpreted([str(ROOT / "tests" / "optim" / "_triton_twin_check.py")])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "max relative error" in res.stdout


def test_grouped_update_launch_matches_one_launch_per_tensor_under_interpreter():
    # update_many: one launch per kind of tensor (the host's ~100 µs per launch bounds a GPU step at batch 1)
    res = _run_interpreted([str(ROOT / "tests" / "optim" / "_triton_group_check.py")])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 failed" in res.stdout and res.stdout.count("\nok ") + res.stdout.startswith("ok ") == 22


def test_forge_in_trainer_through_triton_kernels_equals_adamw_torch():
    res = _run_interpreted([str(ROOT / "tests" / "optim" / "_triton_trainer_check.py")], MEMGRAD_BACKEND="triton")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "max relative weight error" in res.stdout


def test_bf16_model_low_precision_state_triton_path_matches_torch_path_in_trainer():
    # gpu_checks' bf16-model check (bf16 and 8-bit state, clipping) run under the interpreter on CPU
    code = ("import tests.gpu_checks as g; g.check_forge_low_precision_trainer(); "
            "print('FAILED', g.FAILED); raise SystemExit(1 if g.FAILED else 0)")
    res = _run_interpreted(["-c", code], MEMGRAD_CHECK_DEVICE="cpu")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("PASS") == 12  # 4 configurations x (weights apart, update, losses)


def test_forge_step_waits_for_the_device_a_fixed_number_of_times_whatever_the_layers():
    # a GPU's step at batch 1 is bound by the host, which runs ahead only while nothing makes it wait: gpu_checks'
    # count of host reads of device values per step (with 2 and 4 decoder layers) on the Triton path, interpreted
    code = ("import tests.gpu_checks as g; g.check_forge_host_waits(); "
            "print('FAILED', g.FAILED); raise SystemExit(1 if g.FAILED else 0)")
    res = _run_interpreted(["-c", code], MEMGRAD_CHECK_DEVICE="cpu")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("PASS") == 3
