"""The recipes run end to end offline (tiny settings) and print their summary."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script, *args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "recipes" / script), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_grpo_recipe_offline_demo(tmp_path):
    res = _run("grpo.py", "--max_steps", "3", "--output_dir", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "GRPO done: 3 steps" in res.stdout and "optimizer forge_adamw; head memgrad" in res.stdout


def test_sft_recipe_offline_demo(tmp_path):
    # the recipes saved nothing (--output_dir was unused) and could not resume
    from transformers import AutoModelForCausalLM

    res = _run("sft.py", "--max_steps", "3", "--seq", "64", "--batch", "2", "--output_dir", str(tmp_path),
               "--save_steps", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SFT done: 3 steps" in res.stdout and "optimizer forge_adamw; head memgrad" in res.stdout
    assert (tmp_path / "checkpoint-2").is_dir() and (tmp_path / "tokenizer.json").is_file()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)  # plain transformers loads the trained model
    assert "forward" not in saved.__dict__
    res = _run("sft.py", "--max_steps", "3", "--seq", "64", "--batch", "2", "--output_dir", str(tmp_path / "r"),
               "--resume_from_checkpoint", str(tmp_path / "checkpoint-2"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SFT done: 1 steps in" in res.stdout and "(resumed at step 2)" in res.stdout, res.stdout


def test_recipes_document_their_options():
    for script in ("grpo.py", "sft.py"):
        res = _run(script, "--help")
        assert res.returncode == 0 and "--model" in res.stdout and "--optim" in res.stdout
        assert "optimizer steps (default: " in res.stdout  # (each option says what it is, and its default)


def test_what_cannot_be_loaded_is_one_line_not_a_traceback():
    # (a hub name offline, a mistyped path: an 89-line traceback; sft.py --dataset without --model was ignored)
    for script, args in (("sft.py", ["--model", "not/a-local-model"]), ("titans_lm.py", ["--enwik8", "/nonexistent"]),
                         ("sft.py", ["--dataset", "not/a-local-dataset", "--max_steps", "1"])):
        res = _run(script, *args)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (script, res.stderr[-2000:])
        assert res.stderr.startswith("error: ")
        # a missing text file is not a hub problem: the hint says which it is
        hub = "Without --model the recipe runs its offline demo" in res.stderr
        assert hub == (script == "sft.py"), (script, res.stderr)
    res = _run("sft.py", "--model", "/nonexistent/model")  # (was: "Repo id must be in the form ..." first)
    assert res.returncode == 2 and res.stderr.startswith("error: --model /nonexistent/model: no such file"), res.stderr
