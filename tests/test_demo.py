"""The demo runs end to end (tiny settings) and its table shows matching losses."""

import re

from memgrad_hf import cli


def test_demo_runs_and_patched_loss_matches_stock(capsys):
    rc = cli.main(["demo", "--steps", "2", "--batch", "2", "--seq", "32", "--vocab", "2048", "--hidden", "64",
                   "--configs", "stock,patched"])
    out = capsys.readouterr().out
    assert rc == 0, out
    row = next(line for line in out.splitlines() if line.startswith("| patched |"))
    diff = float(row.strip("|").split("|")[-1])
    assert diff < 1e-4, out
    assert re.search(r"\| stock \| \d+", out)


def test_cli_help_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    assert cli.main([]) == 2 and cli.main(["--version"]) == 0  # no command is a usage error
    assert cli.main(["frobnicate"]) == 2
    assert cli.main(["bench", "no_such_bench"]) == 2


def test_unknown_demo_configurations_are_refused(capsys):
    # (a typo ran an unpatched run under its name)
    import pytest

    with pytest.raises(SystemExit):
        cli.main(["demo", "--configs", "stok"])
    assert "unknown stok" in capsys.readouterr().err


def test_demo_sizes_the_model_cannot_run_are_refused(capsys):
    # (every configuration failed with an IndexError / a sampler's error, printed as a row each)
    import pytest

    for flags, said in ((["--vocab", "40"], "tokenizer has"), (["--steps", "0"], "--steps must be at least 1")):
        with pytest.raises(SystemExit):
            cli.main(["demo", *flags])
        assert said in capsys.readouterr().err
