"""Repository hygiene that CI enforces."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    res = subprocess.run([*cmd, "check", str(ROOT)], capture_output=True, text=True)
    if "No module named ruff" in res.stderr:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    assert res.returncode == 0, res.stdout + res.stderr


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest'
    assert cmd in readme
    assert cmd.replace("pip install ", "pip install -q ") in ci
