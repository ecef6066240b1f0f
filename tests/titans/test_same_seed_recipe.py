"""recipes/titans_same_seed.py: torch.func and manual inner gradients train the same model to float noise."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_same_seed_recipe_gap_at_float_noise():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "recipes" / "titans_same_seed.py"), "--steps", "5", "--seq",
                          "48", "--depth", "3", "--activation", "silu", "--no_floor"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    found = re.search(r"same-seed check: 5 steps, largest loss gap ([0-9.e+-]+)", res.stdout)
    assert found, res.stdout
    assert float(found.group(1)) < 1e-5
