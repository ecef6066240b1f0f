"""Benchmark scripts run end to end at toy sizes (numbers are not asserted here: that is RESULTS.md's job)."""

import pytest
import torch

from memgrad_hf import cli


def test_bench_lists_only_runnable_benchmarks(capsys):
    # compat's per-feature modules were listed, then failed with an AttributeError (no main) even for --help
    assert cli.main(["bench"]) == 0
    names = capsys.readouterr().out.split("NAME is one of: ")[1].strip().split(", ")
    assert "compat" in names and "compat_forge" not in names and "harness" not in names
    for name in names:
        assert callable(__import__(f"benchmarks.{name}", fromlist=["main"]).main), name
    assert cli.main(["bench", "compat_forge"]) == 2
    assert "not a benchmark" in capsys.readouterr().err


def test_bench_head_runs_through_the_cli(capsys):
    rc = cli.main(["bench", "head", "--tokens", "64", "--hidden", "16", "--vocab", "256",
                   "--peers", "hf", "torch_lce", "memgrad", "--repeats", "1", "--profile"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| 256 |")]
    assert len(rows) == 3 and all("—" not in r for r in rows), out
    assert out.count("### profile: ") == 3 and "aten::mm" in out and "failed:" not in out


def test_bench_head_memory_runs_through_the_cli(capsys, tmp_path):
    png = tmp_path / "plot.png"
    rc = cli.main(["bench", "head_memory", "--tokens", "32", "--hidden", "16", "--vocab", "256",
                   "--peers", "hf", "memgrad", "--png", str(png)])  # (each cell is a spawned process: ~10 s)
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| 32 |")]
    assert len(rows) == 1 and rows[0].count("MiB") == 2, out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot: matplotlib is not installed" in out and not png.exists()
    else:
        assert png.stat().st_size > 0


def test_bench_compat_reports_exact_for_known_families(capsys):
    rc = cli.main(["bench", "compat", "--timeout", "600", "llama", "gemma2", "bart", "prophetnet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| llama | exact |" in out and "| gemma2 | exact |" in out
    assert "| bart | exact |" in out  # computes nn.CrossEntropyLoss on its own logits: the chunked loss serves it
    assert "| prophetnet | unsupported |" in out  # transposes its logits for its own loss: refused, not wrong


def test_bench_compat_bf16_compares_in_the_models_dtype(capsys):
    # bart's decoder computes its own cross-entropy on bf16 logits: the loss must come back in bf16, as stock's does
    rc = cli.main(["bench", "compat", "--timeout", "600", "--bf16", "llama", "bart"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| llama | close | LlamaForCausalLM (loss torch.float32 vs stock's torch.float32" in out
    assert "| bart | close | BartForCausalLM (loss torch.bfloat16 vs stock's torch.bfloat16" in out


def test_bench_compat_logprobs_checks_the_fused_head(capsys, monkeypatch):
    # big_bird changes its attention type on its first call: the reference must be a first call too; prophetnet
    # returns the first of its n-gram streams as its logits (a select on the probe: the hidden states are selected so)
    rc = cli.main(["bench", "compat", "--timeout", "600", "--logprobs", "llama", "big_bird", "prophetnet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| llama | exact |" in out and "| big_bird | exact |" in out and "| prophetnet | exact |" in out
    # the check can fail: a fused head at another temperature than the reference's is a mismatch
    import functools

    import memgrad_hf.grpo

    monkeypatch.setattr(memgrad_hf.grpo, "add_fused_lm_head",
                        functools.partial(memgrad_hf.grpo.add_fused_lm_head, temperature=0.9))
    assert cli.main(["bench", "compat", "--timeout", "600", "--logprobs", "llama"]) == 1
    assert "| llama | MISMATCH |" in capsys.readouterr().out


def test_bench_grpo_runs_through_the_cli(capsys):
    rc = cli.main(["bench", "grpo", "--completions", "2", "--length", "16", "--vocab", "512", "--hidden", "32",
                   "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert sum(line.startswith(("| full_logits |", "| trl |", "| memgrad |")) for line in out.splitlines()) == 3
    assert "memgrad_torch" not in out  # (the GPU-only peer is not a default row of error on a CPU)


def test_bench_titans_runs_through_the_cli(capsys):
    import importlib.util

    # the optional peer, when absent, is left out with a note rather than shown as a row of error
    installed = importlib.util.find_spec("titans_pytorch") is not None
    layers = ["memgrad"] + (["titans_pytorch"] if installed else [])
    rc = cli.main(["bench", "titans", "--kernel-shapes", "4x8x8x32", "--modes", "train", "--layers", "memgrad",
                   "titans_pytorch",
                   "--batch", "1", "--seq", "12", "--dim", "16", "--heads", "2", "--dim-head", "8", "--chunk", "4",
                   "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith(("| 4x8x8x32 / train |", "| train |"))]
    assert len(rows) == 2 + len(layers) and all("—" not in r for r in rows), out
    assert ("titans_pytorch is not installed" in out) == (not installed), out


def test_bench_evaluate_runs_through_the_cli(capsys):
    rc = cli.main(["bench", "evaluate", "--vocab", "512", "--hidden", "32", "--layers", "1", "--seq", "16",
                   "--rows", "4", "--batch", "2", "--repeats", "1", "--label_smoothing", "0.1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in out.splitlines()
            if line.startswith(("| stock |", "| patched |"))}
    assert len(rows) == 2 and abs(float(rows["stock"]) - float(rows["patched"])) < 1e-5, out  # same eval_loss


def test_bench_masked_lm_runs_through_the_cli(capsys):
    rc = cli.main(["bench", "masked_lm", "--vocab", "512", "--hidden", "64", "--seq", "32", "--batch", "2",
                   "--repeats", "1", "--peers", "stock", "patched"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in out.splitlines()
            if line.startswith(("| stock |", "| patched |"))}
    assert len(rows) == 2 and rows["stock"].count(",") == 1, out  # two steps' losses
    stock, patched = ([float(v) for v in rows[k].split(",")] for k in ("stock", "patched"))
    assert patched == pytest.approx(stock, rel=1e-5), out


def test_bench_forge_host_runs_through_the_cli(capsys):
    rc = cli.main(["bench", "forge_host", "--layers", "4", "--steps", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith(("| adamw_torch_fused", "| forge_adamw"))]
    assert len(rows) == 8 and "failed" not in out, out


def test_bench_forge_runs_through_the_cli(capsys):
    rc = cli.main(["bench", "forge", "--hidden", "32", "--layers", "1", "--vocab", "256", "--batch", "1", "--seq",
                   "16", "--steps", "3", "--repeats", "1", "--configs", "adamw_torch", "forge_adamw+8bit_state+head"])
    out = capsys.readouterr().out
    assert rc == 0, out
    names = ("| adamw_torch |", "| forge_adamw+8bit_state+head |")
    rows = [line for line in out.splitlines() if line.startswith(names)]
    assert len(rows) == 2 and all("—" not in r for r in rows), out


def _alloc_setup(device, mib):
    return {"mib": mib, "device": device}


def _alloc_run(s):
    x = torch.ones(s["mib"] << 18, dtype=torch.float32, device=s["device"])  # mib MiB, touched
    return float(x[-1])


def test_peak_memory_measurement_reads_the_run_alone():
    # the reading every benchmark table rests on: a run allocating 256 MiB adds ~256 MiB, whatever its set-up held
    from benchmarks.harness import Case, _measure, peak_added_mib

    out = _measure(Case("alloc", _alloc_setup, _alloc_run, {"mib": 256}), "cpu", 1)
    assert out["ok"] and 240 <= out["added_mib"] <= 300, out
    with pytest.raises(ValueError, match="fresh process"):  # in this process only where the allocator counts
        peak_added_mib(Case("alloc", _alloc_setup, _alloc_run, {"mib": 1}), "cpu", in_process=True)


def test_bench_grpo_step_runs_through_the_cli(capsys):
    rc = cli.main(["bench", "grpo_step", "--completions", "2", "--length", "8", "--hidden", "32", "--vocab", "256",
                   "--steps", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith(("| adamw_torch", "| forge_adamw"))]
    assert len(rows) == 3 and "—" not in out, out


def test_bench_compat_titans_checks_the_injection(capsys):
    rc = cli.main(["bench", "compat", "--timeout", "600", "--titans", "llama", "mamba"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| llama | exact |" in out
    assert "| mamba | exact, uncached |" in out and "holds no attention layer" in out  # refused cached, by name


def test_bench_compat_titans_in_bf16(capsys):
    # mamba keeps an fp32 residual stream in a bf16 model: the memory branch runs in its own dtype
    rc = cli.main(["bench", "compat", "--timeout", "600", "--titans", "--bf16", "llama", "mamba"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| llama | close |" in out and "| mamba | close, uncached |" in out


def test_bench_compat_forge_steps_like_torch_adamw(capsys, monkeypatch):
    rc = cli.main(["bench", "compat", "--timeout", "600", "--forge", "llama", "roc_bert"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| llama | exact |" in out and "| roc_bert | exact |" in out  # roc_bert edits a linear output in place
    # the check can fail: FORGE with another beta1 than the reference's is a mismatch
    import functools

    import memgrad_hf.optim

    other_beta = functools.partial(memgrad_hf.optim.ForgeAdamW, betas=(0.8, 0.999))
    monkeypatch.setattr(memgrad_hf.optim, "ForgeAdamW", other_beta)
    assert cli.main(["bench", "compat", "--timeout", "600", "--forge", "llama"]) == 1
    assert "| llama | MISMATCH |" in capsys.readouterr().out


def test_bench_compat_forge_in_bf16(capsys, monkeypatch):
    # bf16 weights and state: FORGE rounds once per update where torch's bf16 AdamW rounds after every op, so the
    # updates are compared at 10% where rounding does not decide them (mamba: norm weights and D near 1 do)
    rc = cli.main(["bench", "compat", "--timeout", "600", "--forge", "--bf16", "llama", "mamba"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| llama | close |" in out and "| mamba | close |" in out
    import memgrad_hf.optim

    forge = memgrad_hf.optim.ForgeAdamW

    def twice_the_lr(params, **kw):  # the check can fail: a wrong learning rate is a mismatch
        return forge(params, **{**kw, "lr": 2 * kw["lr"]})

    monkeypatch.setattr(memgrad_hf.optim, "ForgeAdamW", twice_the_lr)
    assert cli.main(["bench", "compat", "--timeout", "600", "--forge", "--bf16", "llama"]) == 1
    assert "| llama | MISMATCH | the updates differ" in capsys.readouterr().out


def test_bench_compat_sweeps_other_model_classes(capsys):
    rc = cli.main(["bench", "compat", "--timeout", "600", "--task", "masked-lm", "modernbert", "bert"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| modernbert | exact | ModernBertForMaskedLM |" in out and "| bert | exact | BertForMaskedLM |" in out
    rc = cli.main(["bench", "compat", "--timeout", "600", "--forge", "--task", "seq2seq", "t5", "switch_transformers"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| t5 | exact | T5ForConditionalGeneration (patched head;" in out
    # its top-1 router flips on rounding-sized weight changes: stock training is no reference there, and says so
    assert "| switch_transformers | untested | chaotic: stock training from weights moved by 1e-7" in out
    with pytest.raises(SystemExit):  # a classifier has no LM head to check
        cli.main(["bench", "compat", "--timeout", "600", "--task", "seq-cls", "llama"])


def test_bench_forge_drift_runs_through_the_cli(capsys):
    rc = cli.main(["bench", "forge_drift", "--hidden", "64", "--layers", "1", "--seq", "16", "--batch", "2", "--steps",
                   "4", "--configs", "forge_adamw", "forge_adamw+8bit_state"])
    out = capsys.readouterr().out
    assert rc == 0, out
    drift = {line.split("|")[1].strip(): float(line.split("|")[-2].split()[0]) for line in out.splitlines()
             if line.startswith(("| adamw_torch |", "| forge_adamw"))}
    assert set(drift) == {"adamw_torch", "forge_adamw", "forge_adamw+8bit_state"}, out
    assert drift["adamw_torch"] == 0 and drift["forge_adamw"] < 1e-4  # fp32 state: float noise
    assert 1e-4 < drift["forge_adamw+8bit_state"] < 1, out  # 8-bit state rounds, within its bound


def test_bench_forge_drift_measures_against_another_reference(capsys):
    rc = cli.main(["bench", "forge_drift", "--hidden", "64", "--layers", "1", "--seq", "16", "--batch", "2", "--steps",
                   "4", "--lr", "3e-4", "--reference", "forge_lion", "--configs", "forge_lion+8bit_state"])
    out = capsys.readouterr().out
    assert rc == 0, out
    drift = {line.split("|")[1].strip(): float(line.split("|")[-2].split()[0]) for line in out.splitlines()
             if line.startswith("| forge_lion")}
    assert list(drift) == ["forge_lion", "forge_lion+8bit_state"], out  # the reference first
    assert drift["forge_lion"] == 0 and 0 < drift["forge_lion+8bit_state"] < 1, out
