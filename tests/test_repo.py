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


def test_gpu_script_names_what_exists():
    """benchmarks/run_gpu.sh runs on a lent GPU with minutes to spare: a module, script or configuration it names
    that does not exist would cost one of them, so every name is checked here (and the script parses)."""
    import importlib.util
    import re

    from benchmarks.forge import CONFIGS

    script = ROOT / "benchmarks" / "run_gpu.sh"
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    lines = script.read_text().splitlines()
    text = "\n".join(re.sub(r"\s#\s.*", "", line) for line in lines if not line.lstrip().startswith("#"))
    text = text.replace("\\\n", " ")
    modules = set(re.findall(r"python -m ([\w.]+)", text))
    assert {"benchmarks.forge", "benchmarks.titans", "benchmarks.grpo"} <= modules
    assert [m for m in modules if importlib.util.find_spec(m) is None] == []
    scripts = set(re.findall(r"python (tests/[\w/]+\.py)", text))
    assert scripts and [s for s in scripts if not (ROOT / s).is_file()] == []
    from benchmarks.forge_host import _PEERS

    known = {"benchmarks.forge": CONFIGS, "benchmarks.forge_host": _PEERS}  # each module's own configurations
    runs = re.findall(r"python -m (benchmarks\.forge\w*)[^\n;|]*?--configs((?:\s+[A-Za-z_][\w+]*)+)", text)
    assert len(runs) == text.count("--configs")
    unknown = [(m, c) for m, names in runs for c in names.split() if c not in known[m]]
    assert runs and unknown == []


def test_subpackages_are_reachable_from_the_package_alone():
    # `import memgrad_hf` then `memgrad_hf.grpo.patch_trl()` (as one writes `torch.nn...`) raised AttributeError
    code = ("import memgrad_hf; memgrad_hf.grpo.patch_trl; memgrad_hf.titans.TitansConfig; "
            "memgrad_hf.callbacks.FANDistillationCallback")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
