"""Benchmark scripts run end to end at toy sizes (numbers are not asserted here: that is RESULTS.md's job)."""

from memgrad_hf import cli


def test_bench_head_runs_through_the_cli(capsys):
    rc = cli.main(["bench", "head", "--tokens", "64", "--hidden", "16", "--vocab", "256",
                   "--peers", "hf", "torch_lce", "memgrad", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| 256 |")]
    assert len(rows) == 3 and all("—" not in r for r in rows), out
