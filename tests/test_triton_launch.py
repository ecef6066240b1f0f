"""FORGE's Triton launches skip Triton's per-call binding (``memgrad_hf.kernels.triton_launch``) without changing
which compiled variant runs or what it is given: checked against Triton's own binder, on CPU."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from memgrad_hf.kernels import triton_launch

ROOT = Path(__file__).resolve().parents[1]


def test_direct_launches_match_what_triton_launches():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MEMGRAD_TRITON_LAUNCH")}
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "_triton_launch_check.py")], cwd=str(ROOT),
                         env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert " 0 failed" in res.stdout


def test_triton_binding_kept_for_unchecked_versions_and_opt_out():
    for version, ok in (("3.4.0", False), ("3.5.1", True), ("3.9.0", True), ("3.10.0", False), ("4.0", False),
                        ("3.9.0+git1234", True), ("nightly", False)):
        assert triton_launch._version_checked(version) is ok, version
    code = "import memgrad_hf.kernels.triton_launch as L; print(L.ENABLED)"
    for value, expect in (("jit", "False"), (" jit ", "False"), ("", "True")):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        out = subprocess.run([sys.executable, "-c", code], env=dict(env, MEMGRAD_TRITON_LAUNCH=value),
                             capture_output=True, text=True, timeout=300).stdout.strip()
        assert out == expect, value


def test_unknown_argument_types_and_argument_widths():
    assert triton_launch._layout((int, float, bool, torch.Tensor), frozenset()) is not None
    assert triton_launch._layout((int, torch.nn.Parameter), frozenset({0})) is not None
    assert triton_launch._layout((int, type(None)), frozenset()) is None  # (Triton makes None a constexpr)
    assert [triton_launch._width(v) for v in (0, 1, -(1 << 31), (1 << 31) - 1, 1 << 31, -(1 << 31) - 1,
                                               (1 << 63) - 1, 1 << 63)] == [0, 0, 0, 0, 1, 1, 1, 2]


def test_launch_host_benchmark_runs():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "benchmarks.triton_launch_host", "--calls", "20", "--repeats", "1"],
                         cwd=str(ROOT), env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("| linear_weight_step") + res.stdout.count("| update_step") == 2, res.stdout
