"""memgrad under DDP and FSDP: two CPU processes (gloo) run by ``torch.distributed.run`` (see _distributed_check.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ddp") / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          str(ROOT / "tests" / "_distributed_check.py"), str(out)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def test_patched_head_under_ddp_equals_stock(report):
    r = report
    assert r["world_size"] == 2
    assert len(r["patched_losses"]) == len(r["stock_losses"]) == 3
    for a, b in zip(r["patched_losses"], r["stock_losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert r["head_weight_rel_err"] < 1e-5  # cross-rank num_items_in_batch honoured: ranks hold different label counts
    assert r["head_rank_spread"] == 0.0


def test_titans_branch_trains_under_ddp(report):
    r = report
    assert len(r["titans_losses"]) == 3 and all(x == x for x in r["titans_losses"])
    assert r["titans_params"] > 0 and r["titans_params_moved"] == r["titans_params"]
    assert r["titans_rank_spread"] == 0.0


def test_forge_is_refused_under_ddp_with_a_clear_error(report):
    msg = report["forge_error"]
    assert msg is not None and "does not support distributed training" in msg and "adamw_torch" in msg


def test_forge_built_before_the_process_group_is_refused_too(report):
    # it trained with no error, each rank from its own gradient: replicas 4e-2 apart after a few steps
    for key in ("forge_early_trainer_error", "forge_early_loop_error"):
        msg = report[key]
        assert msg is not None and "support distributed training" in msg, key
    assert report["forge_early_loop_unchanged"]


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_patched_head_under_fsdp_equals_stock(report, kind, tied):
    r = report[f"{kind}_tied{tied}"]
    assert r["loss_diff"] < 1e-5 and r["weight_rel_err"] < 1e-5 and r["rank_spread"] == 0.0


def test_lm_head_sharded_on_its_own_is_refused_clearly(report):
    msg = report["fsdp_own_head_error"]
    assert msg is not None and "sharded" in msg and "root FSDP unit" in msg and "head=False" in msg


def test_grpo_under_ddp_equals_stock_trl(report):
    (loss_s, norm_s), (loss_m, norm_m) = report["grpo_stock"], report["grpo_patched"]
    assert len(loss_s) == 3
    assert loss_m == pytest.approx(loss_s, rel=1e-5, abs=1e-7)
    assert norm_m == pytest.approx(norm_s, rel=1e-5)
