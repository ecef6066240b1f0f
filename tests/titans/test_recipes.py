"""recipes/titans_lm.py runs end to end offline (tiny settings): FAN distillation, the switch, the counter proof."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "recipes" / "titans_lm.py"), *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_titans_lm_recipe_distils_then_switches_to_the_fan():
    res = _run("--max_steps", "6", "--seq", "64", "--batch", "2", "--fan_distill_steps", "3", "--logging_steps", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "Titans LM done: 6 steps" in out and "bits/char" in out
    m = re.search(r"cosine\(predicted, exact inner gradient\) (-?[\d.]+) at the switch \(step 3\); "
                  r"exact_grad_calls (\d+) at the switch, (\d+) at the end of training", out)
    assert m, out
    assert -1 <= float(m.group(1)) <= 1
    assert int(m.group(2)) == int(m.group(3)) == 3 * (64 // 16)  # 3 steps x 4 chunk calls, then not one more
    assert re.search(r"step +6 .*\(fan\)  exact_grad_calls 12  fan_calls 12", out), out


def test_titans_lm_recipe_reads_enwik8_bytes_without_fan(tmp_path):
    path = tmp_path / "enwik8"
    path.write_bytes(("<page><title>Memory</title><text>remember this: é\n</text></page>\n" * 40).encode())
    res = _run("--enwik8", str(path), "--max_steps", "2", "--seq", "32", "--batch", "2", "--fan_distill_steps", "0",
               "--memory_layers", "0", "1", "--chunk_size", "8")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "memory on layers [0, 1] (2 x NeuralMemory" in res.stdout and "enwik8 (" in res.stdout
    assert "Titans LM done: 2 steps" in res.stdout and "with the exact inner gradient" in res.stdout
    assert "FAN:" not in res.stdout


def test_titans_lm_recipe_documents_its_options():
    res = _run("--help")
    assert res.returncode == 0
    for opt in ("--enwik8", "--text", "--model", "--fan_distill_steps", "--memory_layers", "--chunk_size"):
        assert opt in res.stdout
