"""Inside HF Trainer: patched training equals stock training step by step (GA=2, padding labels)."""

import copy
import time

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import memgrad_hf
from memgrad_hf.callbacks import MemoryReportCallback
from tests.tiny_models import VOCAB, tiny_model


def _data(n=12, t=10):
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (t,), generator=g)
        labels = ids.clone()
        labels[: 1 + i % 4] = -100  # prompt-like masking of varying length
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def _train(model, tmp_path, ga, callbacks=(), **extra):
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=ga,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, **{"optim": "adamw_torch", "lr_scheduler_type": "linear",
                                                  "warmup_steps": 1, **extra},
    )
    trainer = Trainer(model=model, args=args, train_dataset=_data(), callbacks=list(callbacks))
    trainer.train()
    return trainer


@pytest.mark.parametrize("ga", [1, 2])
def test_trainer_losses_and_weights_equal_stock(tmp_path, ga):
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model, chunk_size=4)
    a = _train(model, tmp_path / "a", ga)
    b = _train(ref, tmp_path / "b", ga)
    la = [h["loss"] for h in a.state.log_history if "loss" in h]
    lb = [h["loss"] for h in b.state.log_history if "loss" in h]
    gn_a = [h["grad_norm"] for h in a.state.log_history if "grad_norm" in h]
    gn_b = [h["grad_norm"] for h in b.state.log_history if "grad_norm" in h]
    assert len(la) == 3
    assert la == pytest.approx(lb, rel=1e-5)
    assert gn_a == pytest.approx(gn_b, rel=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), n


@pytest.mark.parametrize("optim", ["sgd", "forge_adamw"])
def test_a_fully_masked_batch_trains_as_stock(tmp_path, optim):
    # batch size 1 and a row whose labels are all -100 (a prompt-only row after truncation): stock logs grad_norm 0
    # there and trains on; the patched model's head gradient was nan, and the Trainer spread it to every weight
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model)
    data = _data(4)
    data[1]["labels"] = [-100] * len(data[1]["labels"])
    runs = []
    for m, o in ((model, optim), (ref, "sgd" if optim == "sgd" else "adamw_torch")):
        args = TrainingArguments(output_dir=str(tmp_path / o), max_steps=4, per_device_train_batch_size=1,
                                 learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                                 use_cpu=True, seed=0, data_seed=0, optim=o)
        trainer = Trainer(model=m, args=args, train_dataset=data)
        trainer.train()
        runs.append([h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h])
    assert 0.0 in runs[1] and runs[0] == pytest.approx(runs[1], rel=1e-5)
    # Adam divides ~1e-9 differences in near-zero gradient elements by their own size: 4e-5 of a weight's range
    tol = 1e-6 if optim == "sgd" else 1e-4
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.isfinite(p).all() and (p - q).abs().max() <= tol * q.abs().max(), n


@pytest.mark.parametrize("family,ga,optim", [("llama", 1, "adamw_torch"), ("llama", 2, "adamw_torch"),
                                             ("llama", 2, "forge_adamw"), ("mixtral", 2, "forge_adamw")])
def test_trainer_label_smoothing_runs_through_the_chunked_head(tmp_path, family, ga, optim):
    # label_smoothing_factor > 0: stock Trainer pops the labels and smooths full logits (LabelSmoother); a patched
    # model computes the same loss in its chunked head, and no training forward returns logits. Without labels an
    # MoE model adds no router loss: neither does the patched one here.
    model = tiny_model(family)
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model, chunk_size=4)
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(out.logits is None) if m.training else None)
    a = _train(model, tmp_path / "a", ga, label_smoothing_factor=0.1, optim=optim, max_grad_norm=1.0)
    b = _train(ref, tmp_path / "b", ga, label_smoothing_factor=0.1, optim="adamw_torch", max_grad_norm=1.0)
    assert seen and all(seen), seen
    for key in ("loss", "grad_norm"):
        got = [h[key] for h in a.state.log_history if key in h and "train_runtime" not in h]
        want = [h[key] for h in b.state.log_history if key in h and "train_runtime" not in h]
        assert len(got) == 3 and got == pytest.approx(want, rel=1e-5), key
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), n


def test_label_smoothing_on_a_model_with_its_own_cross_entropy_runs_as_stock(tmp_path, caplog):
    # bart's decoder applies nn.CrossEntropyLoss itself; Trainer's label smoothing replaces that loss by LabelSmoother
    # on full logits: memgrad leaves that to the stock path (warned), in training and in loss-only evaluation
    model = tiny_model("bart")
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model)
    with caplog.at_level("WARNING", logger="memgrad_hf.patches.trainer"):
        a = _train(model, tmp_path / "a", 1, label_smoothing_factor=0.1)
    b = _train(ref, tmp_path / "b", 1, label_smoothing_factor=0.1)
    assert caplog.text.count("computes its own cross-entropy") == 1
    la, lb = ([h["loss"] for h in t.state.log_history if "loss" in h] for t in (a, b))
    assert len(la) == 3 and la == pytest.approx(lb, rel=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), n
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert a.evaluate(_data())["eval_loss"] == pytest.approx(b.evaluate(_data())["eval_loss"], rel=1e-6)
    # the smoother takes the labels out there: no skip_logits request for the user to fix ("... without labels")
    assert "skip_logits" not in caplog.text


def _masked_lm_data(n=12, t=10):
    g = torch.Generator().manual_seed(4)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (t,), generator=g)
        labels = torch.where(torch.rand(t, generator=g) < 0.3, ids, -100)  # targets at the masked positions
        labels[0] = ids[0]
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


@pytest.mark.parametrize("ga", [1, 2])
def test_masked_lm_trains_and_evaluates_as_stock_without_logits(tmp_path, ga):
    # a masked LM (loss_type ForMaskedLM: unshifted labels) under Trainer: training with label smoothing (stock smooths
    # full logits on unshifted labels; with accumulation, over num_items_in_batch) and loss-only evaluation run
    # through the chunked head, equal to stock
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0, global_attn_every_n_layers=2, local_attention=8))
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model, chunk_size=4)
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(out.logits is None))
    runs = []
    for m in (model, ref):
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=ga, per_device_eval_batch_size=3, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                                 data_seed=0, label_smoothing_factor=0.1, optim="sgd")
        trainer = Trainer(model=m, args=args, train_dataset=_masked_lm_data(), eval_dataset=_masked_lm_data(6))
        trainer.train()
        logged = [h[k] for h in trainer.state.log_history for k in ("loss", "grad_norm") if k in h]
        runs.append((logged, trainer.evaluate()["eval_loss"]))
    assert seen and all(seen), seen
    assert len(runs[0][0]) == 6 and runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)
    assert runs[0][1] == pytest.approx(runs[1][1], rel=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        # (SGD keeps the weights linear in the gradients: AdamW divides rounding-sized gradient differences by the
        # gradients' own size, and its lr-sized steps then differ in the 5th digit)
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("family,smoothing", [("llama", 0.0), ("llama", 0.1), ("mixtral", 0.1)])
def test_loss_only_evaluation_builds_no_logits(tmp_path, family, smoothing):
    # Without compute_metrics (or with prediction_loss_only) the Trainer drops the logits, so the patched model
    # computes the eval loss in chunks; with compute_metrics evaluation returns logits as stock does. eval_loss equals
    # stock in both cases.
    model = tiny_model(family)
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model, chunk_size=4)
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(out.logits is None) if not m.training else None)
    for metrics in (None, lambda pred: {"n": float(len(pred.predictions))}):
        seen.clear()
        results = []
        for m in (model, ref):
            args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=3, report_to="none",
                                     use_cpu=True, label_smoothing_factor=smoothing)
            results.append(Trainer(model=m, args=args, eval_dataset=_data(), compute_metrics=metrics).evaluate())
        assert results[0]["eval_loss"] == pytest.approx(results[1]["eval_loss"], rel=1e-6)
        assert seen and all(s == (metrics is None) for s in seen), (metrics, seen)
        if metrics is not None:
            assert results[0]["eval_n"] == results[1]["eval_n"] > 0


def test_memory_report_callback_logs_metrics(tmp_path):
    cb = MemoryReportCallback()
    trainer = _train(tiny_model("llama"), tmp_path, 1, callbacks=[cb])
    logged = [h for h in trainer.state.log_history if "loss" in h]
    for h in logged:
        assert h["peak_mem_mb"] > 0 and h["peak_added_mem_mb"] >= 0 and h["tokens_per_s"] > 0
        assert h["step_time_s"] > 0
    assert cb.summary["steps"] == 3 and cb.summary["tokens_per_s"] > 0


@pytest.mark.parametrize("verbosity", ["warning", "error"])
def test_memory_report_without_countable_tokens_says_so_once(tmp_path, caplog, verbosity):
    # Batches without the model's main input (here renamed): nothing counts tokens. transformers' warning at every
    # step gives way to one of the callback's, and tokens_per_s is left out rather than logged as 0 (whatever
    # transformers' own log level: its warning is no signal)
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(getattr(hf_logging, verbosity.upper()))
    model = tiny_model("llama")
    model.main_input_name = "pixel_values"
    cb = MemoryReportCallback()
    try:
        with caplog.at_level("WARNING", logger="memgrad_hf"):
            trainer = _train(model, tmp_path, 1, callbacks=[cb])
    finally:
        hf_logging.set_verbosity(level)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and not any("tokens_per_s" in h for h in logged) and "tokens_per_s" not in cb.summary
    assert all(h["peak_mem_mb"] > 0 for h in logged)
    assert sum("tokens_per_s is left out" in r.getMessage() for r in caplog.records) == 1


def test_memory_report_summary_leaves_out_the_first_step(tmp_path):
    # The summary's throughput, like its step time, must not count one-off costs of the first step (compilation,
    # autotuning): a 3 s stall inside step 1 must not show in tokens/s. (Margins of a second or more: CI's CPU is
    # shared and these steps take ~0.2-0.6 s.)
    stall = 3.0

    class SlowFirstStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                time.sleep(stall)

    cb = MemoryReportCallback()
    trainer = _train(tiny_model("llama"), tmp_path, 1, callbacks=[cb, SlowFirstStep()])
    assert cb._step_times[0] >= stall and cb.summary["step_time_s"] <= max(cb._step_times[1:]) + 1e-4  # (rounded)
    tokens_per_step = trainer.state.num_input_tokens_seen / 3
    # the throughput is the later steps' tokens per step over their median time (rounded to 0.1), the same time as
    # step_time_s, so that the two columns of a table agree. With the stall counted, the rate would be below 3 steps'
    # tokens over (stall + their time), far under the lower bound here.
    median = sorted(cb._step_times[1:])[1]
    assert tokens_per_step / (max(cb._step_times[1:]) + 1.0) <= cb.summary["tokens_per_s"]
    assert cb.summary["tokens_per_s"] == pytest.approx(tokens_per_step / median, abs=0.051)


def test_memory_report_added_later_counts_tokens_and_leaves_evaluation_time_out(tmp_path):
    # trainer.add_callback(): the callback never saw on_init_end, where token counting was switched on (tokens_per_s
    # was missing, blamed on the batches); and the throughput divided by wall time, evaluations included (16x low)
    stall = 2.0

    class SlowEvaluation(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            time.sleep(stall)

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
                             eval_strategy="steps", eval_steps=1, save_strategy="no", report_to="none",
                             use_cpu=True, seed=0)
    trainer = Trainer(model=tiny_model("llama"), args=args, train_dataset=_data(), eval_dataset=_data(),
                      callbacks=[SlowEvaluation()])
    cb = MemoryReportCallback()
    trainer.add_callback(cb)
    trainer.train()
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    eval_logs = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(train_logs) == 4 and all(h["tokens_per_s"] > 0 for h in train_logs)
    assert eval_logs and not any("tokens_per_s" in h or "step_time_s" in h for h in eval_logs)
    tokens_per_step = trainer.state.num_input_tokens_seen / 4
    # three steps after the first, 3 evaluations stalled in between: counted, the rate would be under this bound
    assert cb.summary["tokens_per_s"] >= 3 * tokens_per_step / (sum(cb._step_times[1:]) + 1.0)


def test_trainer_bf16_autocast_close_to_stock(tmp_path):
    # accelerate wraps the (patched) forward in autocast; losses agree within bf16 noise.
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model)
    args = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, bf16=True)
    losses = []
    for m in (model, ref):
        t = Trainer(model=m, args=TrainingArguments(**args), train_dataset=_data())
        t.train()
        losses.append([h["loss"] for h in t.state.log_history if "loss" in h])
    assert losses[0] == pytest.approx(losses[1], rel=2e-3)


def test_liger_fused_cross_entropy_on_a_patched_model_is_refused_before_the_first_step(tmp_path):
    # Trainer(use_liger_kernel=True) replaces the model's forward at train(): the chunked head would silently stop
    # running. (Set after construction: liger-kernel itself is not a test dependency.)
    model = memgrad_hf.patch_model(tiny_model("llama"))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=_data())
    batch = {"input_ids": torch.tensor([_data()[0]["input_ids"]]), "labels": torch.tensor([_data()[0]["labels"]])}
    trainer.args.use_liger_kernel = True
    with pytest.raises(ValueError, match="fused_linear_cross_entropy"):
        trainer.compute_loss(model, batch)
    trainer.args.liger_kernel_config = {"fused_linear_cross_entropy": False}  # Liger's other kernels: allowed
    assert torch.isfinite(trainer.compute_loss(model, batch))
