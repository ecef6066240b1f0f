"""FANs: prediction shapes, distillation by cosine, the attach-loss trick, and the Trainer callback's switch."""

import pytest
import torch
from torch import nn

from memgrad_hf.kernels import titans as K
from memgrad_hf.titans import FAN, NeuralMemory
from memgrad_hf.titans.fan import attach_loss
from tests.helpers import rel_err


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny ops gain nothing from a second thread, and OpenMP spin-waiting on a shared 2-core CPU can cost 20x.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _chunk(g=3, c=8, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.rms_norm(torch.randn(g, c, d, generator=gen), (d,))
    v, q = torch.randn(g, c, d, generator=gen), torch.randn(g, 5, d, generator=gen)
    lr = torch.rand(g, c, generator=gen)
    return k, v, q, lr


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("shared", [True, False])
def test_prediction_shapes_and_exact_dgamma(depth, shared):
    d, g = 16, 3
    mem = NeuralMemory(d, depth=depth, expansion=2, fan=True)
    ws = [w.detach() if shared else w.detach().expand(g, *w.shape).clone() for w in mem.memory_weights]
    gamma = torch.randn(d) * 0.1
    k, v, q, lr = _chunk(g, d=d)
    grads, dgamma, retrieved = mem.fan.memory_step(ws, gamma, k, v, lr, q, "gelu")
    exact, exact_dgamma, exact_retrieved, _ = K.memory_step(ws, gamma, k, v, lr, q, "gelu")
    assert [t.shape for t in grads] == [t.shape for t in exact]
    assert mem.fan.widths == [w.shape[1] for w in mem.memory_weights] and mem.fan.calls == 1
    # dgamma needs no backward (sum_t dY_t * H_t) and is exact; retrieval is the memory's own forward.
    assert rel_err(dgamma, exact_dgamma) < 1e-5 and rel_err(retrieved, exact_retrieved) < 1e-5
    assert mem.fan.memory_step(ws, gamma, k, v, lr, None, "gelu")[2] is None


def test_attach_loss_leaves_value_and_gradient_and_trains_the_aux():
    x = torch.randn(4, requires_grad=True)
    p = torch.tensor(2.0, requires_grad=True)
    y = attach_loss(x * 3, p.square(), coef=0.5)
    assert torch.equal(y, x.detach() * 3)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0)) and p.grad.item() == pytest.approx(0.5 * 2 * 2.0)


def _train(mem, steps, lr=3e-3, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.Adam(mem.parameters(), lr=lr)
    cosines = []
    for _ in range(steps):
        x = torch.randn(4, 32, mem.dim)
        y, _ = mem(x)
        loss = (y - x.roll(1, 1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        cosines.append(mem.fan.cosine)
        mem.fan.reset_stats()
    return cosines


def test_distillation_raises_the_cosine():
    torch.manual_seed(0)
    mem = NeuralMemory(32, heads=2, chunk_size=8, max_lr=0.5, fan=True)
    mem.fan.distilling = True
    calls0 = mem.exact_grad_calls
    cos = _train(mem, 80)
    first, last = sum(cos[:5]) / 5, sum(cos[-10:]) / 10
    assert abs(first) < 0.3 and last > 0.6, (first, last)
    assert mem.fan.distill_calls == mem.exact_grad_calls - calls0 == 80 * 4
    per_layer = mem.fan.cosine_per_layer
    assert len(per_layer) == 2


def _outer(mem, x, distill, scale=1.0):
    mem.fan.distilling = distill
    mem.zero_grad(set_to_none=True)
    y, _ = mem(x)
    (scale * (y * torch.linspace(-1, 1, y.shape[-1])).sum()).backward()
    fan_grads = [None if p.grad is None else p.grad.clone() for p in mem.fan.parameters()]
    other = {n: p.grad.clone() for n, p in mem.named_parameters() if not n.startswith("fan.")}
    return y.detach(), fan_grads, other


def test_attach_trick_keeps_output_and_gradients_and_fan_learns_only_from_distillation():
    mem = NeuralMemory(16, heads=2, chunk_size=4, max_lr=0.5, fan=True)
    x = torch.randn(2, 13, 16)
    y_off, fan_off, other_off = _outer(mem, x, False)
    y_on, fan_on, other_on = _outer(mem, x, True)
    _, fan_on3, other_on3 = _outer(mem, x, True, scale=3.0)
    assert torch.equal(y_on, y_off)  # the model's output (and hence loss) is unchanged by distillation
    for n in other_off:  # and so is every gradient of the model's own parameters
        assert torch.equal(other_on[n], other_off[n]), n
        assert rel_err(other_on3[n], 3 * other_off[n]) < 1e-5, n
    assert all(g is None for g in fan_off)  # not distilling: the FAN is outside the graph
    # distilling: the FAN's gradient is the distillation loss's, whatever the outer loss is
    assert all(g is not None and g.abs().sum() > 0 for g in fan_on)
    for a, b in zip(fan_on, fan_on3, strict=True):
        assert torch.equal(a, b)
    # ... and equals the gradient of loss_coef * sum over chunks of the distillation loss, computed directly
    mem.fan.distilling = False
    losses = []
    real_step = mem._inner_step

    def spy(weights, gamma, k, v, lr, q):
        grads, dgamma, retrieved = real_step(weights, gamma, k, v, lr, q)
        losses.append(mem.fan.distill_loss(weights, gamma, k, v, lr, grads, mem.activation)[0])
        return grads, dgamma, retrieved

    mem._inner_step = spy
    mem(x)
    del mem._inner_step
    direct = torch.autograd.grad(mem.fan.loss_coef * sum(losses), list(mem.fan.parameters()))
    for a, b in zip(fan_on, direct, strict=True):
        assert rel_err(a, b) < 1e-5


def test_fan_mode_uses_no_exact_gradient():
    mem = NeuralMemory(16, heads=2, chunk_size=4, fan=True)
    x = torch.randn(2, 16, 16)
    y_exact, _ = mem(x)
    calls = mem.exact_grad_calls
    mem.grad_impl = "fan"
    y_fan, _ = mem(x)
    y_fan.sum().backward()
    assert mem.exact_grad_calls == calls and mem.fan.calls == 4
    assert not torch.allclose(y_fan, y_exact)
    assert torch.equal(y_fan[:, :4], y_exact[:, :4])  # the first chunk is read from the initial memory


def test_fan_and_callback_errors():
    from memgrad_hf.callbacks import FANDistillationCallback

    with pytest.raises(ValueError, match="fan=True"):
        NeuralMemory(16, grad_impl="fan")
    with pytest.raises(ValueError, match="depth"):
        FAN(16, [64, 16]).predict([torch.randn(16, 16)], torch.zeros(16), *_chunk()[:2], _chunk()[3])
    with pytest.raises(ValueError, match="fan=True"):
        FANDistillationCallback(distill_steps=1).on_train_begin(None, None, None, model=NeuralMemory(16))
    # 0 switched at once to an untrained FAN, silently
    for kw in ({"distill_steps": "3"}, {"distill_epochs": float("nan")}, {"distill_steps": 0}, {"distill_epochs": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            FANDistillationCallback(**kw)


def test_fp16_distillation_is_refused_and_an_idle_fan_is_warned_about(caplog):
    import logging
    import types

    from memgrad_hf.callbacks import FANDistillationCallback

    # a GradScaler would divide the FAN's fixed-coefficient gradient by the loss scale (65536x smaller with SGD)
    with pytest.raises(ValueError, match="bf16=True"):
        FANDistillationCallback(distill_steps=1).on_train_begin(types.SimpleNamespace(fp16=True), None, None,
                                                                model=NeuralMemory(16, fan=True))
    mem = NeuralMemory(16, heads=2, chunk_size=4, fan=True).train()
    x = torch.randn(1, 8, 16)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        mem(x)  # fan=True, trainable, neither distilled nor used: its parameters never get a gradient
        assert caplog.text.count("neither distilled nor used") == 1
        mem(x)
        mem.fan.distilling = True
        with torch.autocast("cpu", dtype=torch.float16):
            mem(x)
    assert caplog.text.count("neither distilled nor used") == 1 and "under fp16 autocast" in caplog.text


# -- Trainer ----------------------------------------------------------------------------------------------------------
class TinyMemoryLM(nn.Module):
    """A minimal LM around one NeuralMemory (the Trainer accepts any module returning a loss)."""

    def __init__(self, vocab=32, dim=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mem = NeuralMemory(dim, heads=2, chunk_size=8, max_lr=0.5, fan=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels=None):
        h = self.emb(input_ids)
        h = h + self.mem(h)[0]
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss, "logits": logits}


def _trainer(model, cb, steps, tmp_path):
    from transformers import Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (steps * 2, 32), generator=gen)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                             learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to="none",
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])


def test_callback_distils_then_switches_and_no_exact_gradient_after(tmp_path):
    from memgrad_hf.callbacks import FANDistillationCallback

    torch.manual_seed(0)
    model = TinyMemoryLM()
    calls_seen = []

    class Probe(FANDistillationCallback):  # records the counters after every step
        def on_step_end(self, args, state, control, **kw):
            super().on_step_end(args, state, control, **kw)
            calls_seen.append((state.global_step, model.mem.exact_grad_calls, model.mem.fan.calls))

    cb = Probe(distill_steps=4)
    trainer = _trainer(model, cb, 8, tmp_path)
    trainer.train()
    assert cb.switched and cb.switch_step == 4 and model.mem.grad_impl == "fan"
    assert cb.exact_calls_at_switch == 4 * 4 == calls_seen[3][1]  # 4 steps x 4 chunks, all exact
    # the counter proof: not one exact inner-gradient call after the switch, and the FAN did the work
    assert [c[1] for c in calls_seen[4:]] == [cb.exact_calls_at_switch] * 4
    assert calls_seen[-1][2] == 4 * 4 and calls_seen[3][2] == 0
    assert not any(p.requires_grad for p in model.mem.fan.parameters())  # frozen after the switch
    assert -1 <= cb.cosine_at_switch <= 1 and cb.summary["fan_mode"] == 1
    logs = [h for h in trainer.state.log_history if "fan_cosine" in h]
    assert len(logs) >= 8 and logs[0]["fan_mode"] == 0 and logs[-1]["fan_mode"] == 1
    assert logs[-1]["fan_exact_grad_calls"] == cb.exact_calls_at_switch


@pytest.mark.parametrize("epochs, switch", [(1, 4), (0.5, 2)])  # a fraction switches mid-epoch
def test_callback_on_a_patched_llama_switches_after_an_epoch(tmp_path, epochs, switch):
    import memgrad_hf
    from memgrad_hf.callbacks import FANDistillationCallback
    from memgrad_hf.titans import TitansConfig
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    memgrad_hf.patch_model(model, titans=TitansConfig(layers=[0, -1], heads=2, chunk_size=8, fan=True))
    mems = [m for m in model.modules() if isinstance(m, NeuralMemory)]
    cb = FANDistillationCallback(distill_epochs=epochs)
    trainer = _trainer(model, cb, 4, tmp_path)
    trainer.args.max_steps, trainer.args.num_train_epochs = -1, 2  # 2 epochs of 4 steps (8 rows, batch 2)
    trainer.train_dataset = trainer.train_dataset[:8]
    trainer.train()
    assert cb.switched and cb.switch_step == switch and all(m.grad_impl == "fan" for m in mems)
    assert cb.exact_calls_at_switch == sum(m.exact_grad_calls for m in mems) == 2 * 4 * switch  # none after it
    assert all(m.fan.calls == 4 * (8 - switch) for m in mems)
    assert cb.summary["fan_mode"] == 1 and len(cb.summary["cosine_per_memory"]) == 2
    # what is saved records the switch, so a reload computes what ran (config.json said "manual": outputs differed)
    from memgrad_hf.titans import from_pretrained, load_titans, save_titans

    assert model.config.memgrad_titans["grad_impl"] == "fan"
    model.eval().save_pretrained(tmp_path / "saved")
    save_titans(model, tmp_path / "memory")
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(tmp_path / "saved").eval()(ids).logits, model(ids).logits,
                                   rtol=1e-5, atol=1e-5)
    alone = load_titans(tiny_model("llama"), tmp_path / "memory")  # the memory file's own config
    assert {m.grad_impl for m in alone.modules() if isinstance(m, NeuralMemory)} == {"fan"}
    # and the FANs frozen at the switch (freeze_fan_after) come back frozen: they kept training after a reload
    assert model.config.memgrad_titans["fan_frozen"]
    # into a model already patched with fan=True (as PEFT needs): the saved gradient and frozen FANs too (it ran the
    # exact gradient with trainable FANs: logits 0.38 off)
    into = tiny_model("llama")
    into.load_state_dict({k: v for k, v in model.state_dict().items() if "titans" not in k}, strict=False)
    memgrad_hf.patch_model(into, titans=TitansConfig(layers=[0, -1], heads=2, chunk_size=8, fan=True))
    for source in (tmp_path / "memory", tmp_path / "saved"):  # the memory file's metadata; config.json
        load_titans(into, source)
        with torch.no_grad():
            torch.testing.assert_close(into.eval()(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
        assert into.config.memgrad_titans["grad_impl"] == "fan" and into.config.memgrad_titans["fan_frozen"]
    for reloaded in (from_pretrained(tmp_path / "saved"), alone, into):
        fans = [m.fan for m in reloaded.modules() if isinstance(m, NeuralMemory)]
        assert fans and not any(q.requires_grad for f in fans for q in f.parameters())


@pytest.mark.parametrize("restore,at", [(False, 6), (True, 6), (True, 2)])
def test_a_run_resumed_after_the_switch_ends_as_the_uninterrupted_one(tmp_path, restore, at):
    # distill_epochs: a run resumed past the switch distilled again (the callback checked distill_steps only): 4e-3
    # off; with restore_callback_states_from_checkpoint the switch and its counters are the uninterrupted run's, and
    # so is the FAN cosine from a checkpoint before the switch (its window of recent cosines was not saved)
    import memgrad_hf
    from memgrad_hf.callbacks import FANDistillationCallback
    from memgrad_hf.titans import TitansConfig
    from tests.tiny_models import tiny_model

    def run(out, resume=None):
        model = tiny_model("llama")
        memgrad_hf.patch_model(model, titans=TitansConfig(layers=[0, -1], heads=2, chunk_size=4, max_lr=0.5, fan=True))
        cb = FANDistillationCallback(distill_epochs=0.5)  # 8 steps per epoch: the switch at step 4
        trainer = _trainer(model, cb, 8, out)
        trainer.args.save_strategy, trainer.args.save_steps = "steps", 2
        trainer.args.restore_callback_states_from_checkpoint = restore
        trainer.train(resume_from_checkpoint=resume)
        cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, FANDistillationCallback))
        return model, cb

    full, cb_full = run(tmp_path / "full")
    resumed, cb_res = run(tmp_path / "res", resume=str(tmp_path / "full" / f"checkpoint-{at}"))
    for (n, p), q in zip(full.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert cb_full.switch_step == 4 and cb_res.switched
    if restore:
        for k in ("switch_step", "cosine_at_switch", "exact_calls_at_switch", "fan_exact_grad_calls", "fan_calls",
                  "cosine_per_memory"):
            assert cb_res.summary[k] == pytest.approx(cb_full.summary[k], rel=1e-6), k
    else:  # unknown without the saved state: said so (it reported 0 exact calls at the switch)
        assert cb_res.exact_calls_at_switch is None and cb_res.summary["exact_calls_at_switch"] is None


def test_load_best_model_at_end_gives_the_memories_the_best_checkpoints_mode(tmp_path):
    # the Trainer reloads the best checkpoint's weights only: one saved before the switch computed with the exact
    # gradient, but the memories stayed in "fan" mode (evaluate() 4.1533 against the best metric 4.1652)
    from memgrad_hf.callbacks import FANDistillationCallback

    torch.manual_seed(0)
    model = TinyMemoryLM()
    cb = FANDistillationCallback(distill_steps=4)
    trainer = _trainer(model, cb, 6, tmp_path)
    trainer.eval_dataset = trainer.train_dataset[:4]
    for k, v in dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                     load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True).items():
        setattr(trainer.args, k, v)  # the highest loss: step 2's checkpoint, before the switch
    trainer.train()
    assert cb.switch_step == 4 and trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert model.mem.grad_impl == "manual" and all(p.requires_grad for p in model.mem.fan.parameters())
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trainer.state.best_metric, rel=1e-6)


def test_fans_saved_frozen_are_distilled_again_by_a_new_run(tmp_path):
    # a model saved after the switch loads its FANs frozen; the Trainer built its optimizer before the callback made
    # them trainable, so a second distillation changed nothing (and a resume could not match the optimizer's groups)
    from memgrad_hf.callbacks import FANDistillationCallback

    torch.manual_seed(0)
    model = TinyMemoryLM()
    model.mem.fan.requires_grad_(False)  # as reloaded after a switch
    before = [p.detach().clone() for p in model.mem.fan.parameters()]
    _trainer(model, FANDistillationCallback(distill_steps=2), 3, tmp_path).train()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.mem.fan.parameters(), strict=True))
    # added after the optimizer was built, the callback cannot make it hold them: it says so
    trainer = _trainer(model, FANDistillationCallback(distill_steps=2), 3, tmp_path / "b")
    trainer.callback_handler.callbacks.pop()
    model.mem.fan.requires_grad_(False)
    trainer.create_optimizer()
    trainer.add_callback(FANDistillationCallback(distill_steps=2))
    with pytest.raises(ValueError, match="optimizer does not hold the FANs"):
        trainer.train()


def test_distillation_under_gradient_accumulation_is_the_mean_over_micro_batches(tmp_path):
    # The FAN's loss was attached at full weight on every micro-batch: 2 accumulation steps of 1 row gave it twice
    # the gradient of 1 step of 2 rows (the model's own loss is divided by the Trainer). Plain SGD shows the scale.
    import copy

    from transformers import Trainer, TrainingArguments

    from memgrad_hf.callbacks import FANDistillationCallback

    torch.manual_seed(0)
    base = TinyMemoryLM()
    base.mem.fan.loss_coef = 1.0
    rows = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in rows]
    trained = []
    for batch, accumulation in ((2, 1), (1, 2)):
        model = copy.deepcopy(base)
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=0.5,
                                 max_grad_norm=0.0, lr_scheduler_type="constant", save_strategy="no",
                                 report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FANDistillationCallback()])
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(data)
        trainer.train()
        assert model.mem.fan.accumulation_steps == 1  # reset after training
        trained.append(model)
    fans = (trained[0].mem.fan.parameters(), base.mem.fan.parameters())
    moved = [(a - b).abs().max().item() for a, b in zip(*fans, strict=True)]
    assert min(moved) > 1e-4  # the step did train the FAN
    for (name, a), b in zip(trained[0].named_parameters(), trained[1].parameters(), strict=True):
        assert rel_err(a, b) < 1e-5, name


def test_with_peft_only_the_trainable_copy_is_distilled_and_switched(tmp_path):
    # PEFT's modules_to_save keeps the frozen original memory beside its trainable copy: the callback made the
    # original's FAN trainable (into the optimizer) and switched it to its untrained FAN, so disable_adapter() no
    # longer computed the base model
    from peft import LoraConfig, get_peft_model

    import memgrad_hf
    from memgrad_hf.callbacks import FANDistillationCallback
    from memgrad_hf.titans import TitansConfig
    from tests.tiny_models import tiny_model

    model = memgrad_hf.patch_model(tiny_model("llama"), head=False,
                                   titans=TitansConfig(layers=[-1], heads=2, chunk_size=8, fan=True))
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["titans_memory"]))
    (original, copy), names = zip(*[(m, n) for n, m in pm.named_modules() if isinstance(m, NeuralMemory)],
                                  strict=True)
    assert "original_module" in names[0] and "modules_to_save" in names[1]
    cb = FANDistillationCallback(distill_steps=1)
    trainer = _trainer(pm, cb, 2, tmp_path)
    trainer.train()
    assert cb.memories == [copy] and copy.grad_impl == "fan" and original.grad_impl == "manual"
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in held or p.requires_grad for p in original.fan.parameters())
    assert model.config.memgrad_titans["grad_impl"] == "fan"  # what a merged model saves


def test_a_frozen_fan_stays_frozen_after_peft_disable_adapter(tmp_path):
    # PEFT's disable_adapter() (TRL's reference pass) re-enables every parameter of a modules_to_save copy on exit:
    # the frozen FAN then trained on the model's loss, and a save recorded it as not frozen
    from peft import LoraConfig, get_peft_model
    from transformers import TrainerCallback

    import memgrad_hf
    from memgrad_hf.callbacks import FANDistillationCallback
    from memgrad_hf.titans import TitansConfig
    from tests.tiny_models import tiny_model

    model = memgrad_hf.patch_model(tiny_model("llama"), head=False,
                                   titans=TitansConfig(layers=[-1], heads=2, chunk_size=8, fan=True))
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["titans_memory"]))
    copy = [m for n, m in pm.named_modules() if isinstance(m, NeuralMemory) and "modules_to_save" in n][0]
    at_switch = {}

    class ReferencePass(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                at_switch.update({n: p.detach().clone() for n, p in copy.fan.named_parameters()})
                with pm.disable_adapter(), torch.no_grad():
                    pm(input_ids=torch.randint(0, 32, (1, 16)))

    trainer = _trainer(pm, FANDistillationCallback(distill_steps=1), 3, tmp_path)
    trainer.add_callback(ReferencePass())
    trainer.train()
    assert copy.grad_impl == "fan" and copy.fan.calls > 0
    for n, p in copy.fan.named_parameters():
        assert torch.equal(p, at_switch[n]), n
    memgrad_hf.patches.titans.sync_titans_config(pm)
    assert model.config.memgrad_titans["fan_frozen"] is True


def test_an_evaluation_before_training_logs_the_exact_calls_it_made(tmp_path):
    # the callback found the memories at train begin only: an evaluate() first logged 0 exact calls after making some
    from memgrad_hf.callbacks import FANDistillationCallback

    torch.manual_seed(0)
    model = TinyMemoryLM()
    trainer = _trainer(model, FANDistillationCallback(distill_steps=1), 1, tmp_path)
    metrics = trainer.evaluate(trainer.train_dataset)
    assert metrics["fan_exact_grad_calls"] == model.mem.exact_grad_calls > 0 and metrics["fan_mode"] == 0


def test_forge_trains_a_distilling_fan_exactly_without_calling_its_reuse_an_accident(caplog):
    # the FAN runs once per memory chunk by design: FORGE warned "used more than once before one backward (a layer
    # called twice, ...)" on every run with fan=True
    import copy
    import logging

    from memgrad_hf.optim import ForgeAdamW

    torch.manual_seed(0)
    model = TinyMemoryLM()
    model.mem.fan.distilling = True
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ids = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        for _ in range(2):
            opt.backward(model(ids, ids)["loss"])
            opt.step()
            ref(ids, ids)["loss"].backward()
            ref_opt.step()
            ref_opt.zero_grad()
    opt.detach()
    assert "more than once" not in caplog.text and "uses in the loss" not in caplog.text, caplog.text
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert rel_err(p, q) < 1e-5, name
