"""FORGE beyond one layer call per backward: weights used several times, parameters that start training later, the
optimizer's life around Trainer.train(), and what it refuses. Each case against torch.optim (fp32)."""

import copy
import inspect
import logging

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainerCallback

import memgrad_hf  # noqa: F401  (registers forge_*)
from memgrad_hf import patch_model
from memgrad_hf.optim import ForgeAdamW, ForgeSGD
from tests.optim.test_forge_trainer import _args, _assert_weights_close, _train
from tests.test_trainer_integration import _data
from tests.tiny_models import tiny_model


class _SharedNet(nn.Module):
    """An embedding and a linear layer each used twice per forward (ALBERT's shared layers, a re-used embedding)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 16)
        self.shared = nn.Linear(16, 16)
        self.out = nn.Linear(16, 5)

    def forward(self, ids, ids2, target):
        h = self.emb(ids) + self.emb(ids2).flip(1)
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1), target.flatten())


class _InPlaceAfterLinear(_SharedNet):
    """A biased linear layer on 3-D input whose output is edited in place (roc_bert's attention does so)."""

    def forward(self, ids, ids2, target):
        h = self.shared(self.emb(ids))
        h.mul_(0.5).add_(self.emb(ids2))
        return nn.functional.cross_entropy(self.out(torch.tanh(h)).flatten(0, 1), target.flatten())


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 20, (3, 6), generator=g), torch.randint(0, 20, (3, 6), generator=g),
            torch.randint(0, 5, (3, 6), generator=g))


def _step_both(model, opt, ref, ref_opt, loss, max_grad_norm=0.0, via_opt=False):
    """One step of the FORGE optimizer on ``model`` and of its torch.optim reference on ``ref`` (``loss(m)`` gives a
    model's loss; the reference clips over its optimizer's parameters). ``via_opt``: FORGE's backward runs through
    ``opt.backward``."""
    opt.backward(loss(model)) if via_opt else loss(model).backward()
    opt.step()
    loss(ref).backward()
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_([p for g in ref_opt.param_groups for p in g["params"]], max_grad_norm)
    ref_opt.step()
    ref_opt.zero_grad()


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["no_clip", "exact_clip"])
def test_layers_called_twice_are_updated_once_from_their_summed_gradient(max_grad_norm, caplog):
    model, ref = _SharedNet(), _SharedNet()
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        for step in range(3):
            _step_both(model, opt, ref, ref_opt, lambda m, s=step: m(*_batch(s)), max_grad_norm, via_opt=True)
    _assert_weights_close(model, ref)
    assert {p for p in (model.emb.weight, model.shared.weight)} <= opt._warned_shared  # out.weight stays fused
    assert model.out.weight not in opt._warned_shared
    # one line per reason, the first weight in full, the others named on one more line at step()
    warned = [r.getMessage() for r in caplog.records if "more than once" in r.getMessage()]
    assert len(warned) == 2 and "emb.weight is used more than once" in warned[0], warned
    assert "as above, 1 more weight is used more than once" in warned[1] and "shared.weight" in warned[1], warned


def test_a_linear_output_edited_in_place_trains_as_torch():
    # F.linear of 3-D input with a bias returns a view of its 2-D addmm; returned from FORGE's autograd Function, an
    # in-place op on it raised ("a view ... modified inplace") where nn.Linear's output allows it
    model = _InPlaceAfterLinear()
    ref = copy.deepcopy(model)
    opt, ref_opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for batch in map(_batch, range(3)):
        _step_both(model, opt, ref, ref_opt, lambda m, b=batch: m(*b))
    _assert_weights_close(model, ref)


def test_two_forwards_then_one_backward_equal_torch():
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    a, b = torch.randint(1, 100, (2, 8)), torch.randint(1, 100, (2, 8))
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):  # e.g. chosen and rejected in separate forwards, one loss
            (m(input_ids=a, labels=a).loss + 0.5 * m(input_ids=b, labels=b).loss).backward()
            o.step()
            o.zero_grad()
    _assert_weights_close(model, ref)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["no_clip", "exact_clip"])
def test_a_weight_also_used_outside_its_layer_is_found_in_the_graph_and_exact(max_grad_norm, caplog):
    # optimizer.backward(loss) (and the Trainer's backward) walk the first loss's graph: a penalty on a fused weight
    # is a second edge into its gradient accumulator, so its parts are summed before its first update
    def loss_of(m, step):
        return m(*_batch(step)) + 0.1 * m.out.weight.square().sum() + 0.1 * m.emb.weight.square().sum()

    model, ref = _SharedNet(), _SharedNet()
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        for step in range(3):
            _step_both(model, opt, ref, ref_opt, lambda m, s=step: loss_of(m, s), max_grad_norm, via_opt=True)
    _assert_weights_close(model, ref)
    assert "out.weight has 2 uses in the loss's graph" in caplog.text


def test_a_use_outside_its_layer_seen_only_at_the_hook_is_warned_about_and_exact_from_the_next_step(caplog):
    def loss_of(m, step):
        return m(*_batch(step)) + 0.1 * m.out.weight.square().sum()  # a penalty on a fused weight

    # a plain loss.backward(): SGD without momentum, where the first step's separate update sums to the same step
    model, ref = _SharedNet(), _SharedNet()
    opt, ref_opt = ForgeSGD(model.parameters(), model=model, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        for step in range(3):
            _step_both(model, opt, ref, ref_opt, lambda m, s=step: loss_of(m, s))
    _assert_weights_close(model, ref)
    assert "out.weight is also used outside its layer" in caplog.text
    # one backward per step: nothing says "a second backward", nor that this step's two updates were one
    assert "second backward" not in caplog.text and "then applied once" not in caplog.text.split("from now on")[0]
    # AdamW: from the step after the warning on, equal to torch from the same weights and state
    model = _SharedNet()
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    loss_of(model, 0).backward()
    opt.step()
    ref = copy.deepcopy(model)
    for m in ref.modules():
        m.__dict__.pop("forward", None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict({k: v for k, v in copy.deepcopy(opt.state_dict()).items() if k != "forge"})
    for step in (1, 2):
        _step_both(model, opt, ref, ref_opt, lambda m, s=step: loss_of(m, s))
    _assert_weights_close(model, ref)


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["no_clip", "exact_clip"])
def test_a_use_outside_its_layer_added_after_the_first_step_is_warned_once_and_summed_from_then_on(max_grad_norm,
                                                                                                   caplog):
    # the graph is walked at the first backward only: a penalty switched on later (after warmup) is found at the hook,
    # its step applies two updates (exact for plain SGD without clipping), and the replay of the norm pass applied
    # the second part as "a second backward", a false warning
    def loss_of(m, step):
        return m(*_batch(step)) + (0.1 * m.out.weight.square().sum() if step >= 2 else 0.0)

    model, ref = _SharedNet(), _SharedNet()
    opt = ForgeSGD(model.parameters(), model=model, lr=0.1, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        for step in range(4):
            _step_both(model, opt, ref, ref_opt, lambda m, s=step: loss_of(m, s), max_grad_norm, via_opt=True)
    assert caplog.text.count("out.weight is also used outside its layer") == 1
    assert "second backward" not in caplog.text
    assert model.out.weight in opt._shared  # from the step after on: summed by autograd, one update
    if not max_grad_norm:
        _assert_weights_close(model, ref)


def test_accelerate_unwrap_without_the_fp32_wrapper_keeps_memgrads_forward(caplog):
    # unwrap_model(keep_fp32_wrapper=False) follows __wrapped__ down to the class's forward: memgrad's wrappers
    # carried one, so the chunked head (full logits again) and FORGE's clipping root were silently dropped
    from accelerate import Accelerator

    model = tiny_model("llama")
    patch_model(model)
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=0.5)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(0))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    out = plain(input_ids=ids, labels=ids)
    assert out.logits is None  # the chunked head: no [tokens x vocab] logits in a training forward
    out.loss.backward()  # exact clipping needs the loss to come from model(...): it still does
    opt.step()
    assert opt.optimizer.last_grad_norm > 0
    assert inspect.signature(plain.forward) == inspect.signature(type(plain).forward.__get__(plain))
    opt.optimizer.detach()


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5], ids=["no_clip", "exact_clip"])
def test_a_penalty_on_the_chunked_heads_weight_is_summed_before_its_update(max_grad_norm):
    model = memgrad_hf.patch_model(tiny_model("llama"))
    ref = memgrad_hf.patch_model(tiny_model("llama"))  # the same head math: what differs is the optimizer
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ids = torch.randint(1, 100, (2, 8))
    for _ in range(3):
        _step_both(model, opt, ref, ref_opt,
                   lambda m: m(input_ids=ids, labels=ids).loss + 0.05 * m.lm_head.weight.square().sum(),
                   max_grad_norm, via_opt=True)
    # (with clipping, FORGE's fp64-summed norm and clip_grad_norm_'s fp32 one set coefficients ~1e-7 apart)
    _assert_weights_close(model, ref, rtol=5e-5 if max_grad_norm else 1e-6)
    assert model.lm_head.weight in opt._shared


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["no_clip", "exact_clip"])
def test_parameters_unfrozen_or_added_later_train_like_torch(max_grad_norm):
    model, ref = _SharedNet(), _SharedNet()
    for m in (model, ref):
        m.out.bias.requires_grad_(False)  # frozen now, unfrozen after the first step
    groups = lambda m: [p for n, p in m.named_parameters() if not n.startswith("shared")]  # noqa: E731
    opt = ForgeAdamW(groups(model), model=model, lr=1e-2, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2)
    for step in range(3):
        if step == 1:
            opt.add_param_group({"params": list(model.shared.parameters()), "lr": 3e-2})
            ref_opt.add_param_group({"params": list(ref.shared.parameters()), "lr": 3e-2})
            model.out.bias.requires_grad_(True)
            ref.out.bias.requires_grad_(True)
        _step_both(model, opt, ref, ref_opt, lambda m, s=step: m(*_batch(s)), max_grad_norm, via_opt=True)
    _assert_weights_close(model, ref)
    assert not torch.equal(model.out.bias, _SharedNet().out.bias)  # it did train


def test_the_trainer_detaches_forge_when_training_ends_and_attaches_it_again(tmp_path):
    model = tiny_model("llama")
    trainer, _, _ = _train(model, _args(tmp_path / "a", "forge_adamw", max_steps=2))
    opt = trainer.optimizer.optimizer
    ids = torch.randint(1, 100, (2, 8))
    before = [p.detach().clone() for p in model.parameters()]
    model(input_ids=ids, labels=ids).loss.backward()  # e.g. a saliency map after training: plain gradients
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)  # then another optimizer trains the model as it would any model
    _, la, ga = _train(model, _args(tmp_path / "b", "adamw_torch", max_steps=2))
    _, lb, _ = _train(ref, _args(tmp_path / "c", "adamw_torch", max_steps=2))
    assert la == pytest.approx(lb, rel=1e-6) and all(g > 0 for g in ga)
    trainer.train()  # the first Trainer again: FORGE is attached for the run, detached after
    assert not opt._attached and all(p.grad is None for p in model.parameters())
    assert trainer.state.global_step == 2 and not all(
        torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


def test_a_second_backward_before_step_is_warned_about(caplog):
    model = _SharedNet()
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        model(*_batch(0)).backward()
        model(*_batch(1)).backward()  # a hand-written accumulation without opt.sync = False
        opt.step()
    assert caplog.text.count("optimizer.sync = False") == 1


def test_a_refused_backward_moves_no_step_count():
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=1.0)
    ids = torch.randint(1, 100, (2, 8))
    out = model(input_ids=ids, labels=ids, return_dict=False)  # a tuple: the loss is not wrapped for the norm pass
    with pytest.raises(RuntimeError, match="optimizer.backward"):
        out[0].backward()
    assert all(int(st["step"]) == 0 for st in opt.state.values())
    model.zero_grad(set_to_none=True)
    opt.backward(model(input_ids=ids, labels=ids, return_dict=False)[0])  # the fix the message names
    opt.step()
    assert {int(st["step"]) for st in opt.state.values()} == {1}


def test_fp16_autocast_in_a_hand_written_loop_is_refused():
    model = tiny_model("llama")
    ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ids = torch.randint(1, 100, (2, 8))
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="bf16 autocast"):
        model(input_ids=ids, labels=ids)
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        model(input_ids=ids)  # inference under fp16 autocast is fine


def test_trainer_second_train_call_reattaches(tmp_path):
    model = tiny_model("llama")
    trainer = Trainer(model=model, args=_args(tmp_path, "forge_adamw", max_steps=1), train_dataset=_data())
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert not opt._attached
    opt.attach()
    assert opt._attached and opt._swapped
    opt.detach()


def test_option_spellings_users_reach_for(tmp_path):
    model = tiny_model("llama")
    t = Trainer(model=model, args=_args(tmp_path, "forge_adamw", optim_args="tile_bytes=4MiB"), train_dataset=_data())
    t.create_optimizer()
    assert t.optimizer.tile_bytes == 4 << 20
    t.optimizer.detach()
    with pytest.raises(ValueError, match="--max_grad_norm 0.5"):
        Trainer(model=model, args=_args(tmp_path, "forge_adamw", optim_args="max_grad_norm=0.5"),
                train_dataset=_data()).create_optimizer()
    with pytest.raises(ValueError, match="4MiB"):
        Trainer(model=model, args=_args(tmp_path, "forge_adamw", optim_args="tile_bytes=lots"),
                train_dataset=_data()).create_optimizer()
    with pytest.raises(ValueError, match=r"key=value pairs .* \['clip'\] are not"):
        Trainer(model=model, args=_args(tmp_path, "forge_adamw", optim_args="clip"),
                train_dataset=_data()).create_optimizer()
    with pytest.raises(ValueError, match="momentum must be a number"):
        Trainer(model=model, args=_args(tmp_path, "forge_sgd", optim_args="momentum=abc"),
                train_dataset=_data()).create_optimizer()
    t = Trainer(model=model, args=_args(tmp_path, "forge_adamw", optim_args="clip=Exact, clip_pass=REPLAY"),
                train_dataset=_data())
    t.create_optimizer()  # values in any case, spaces around them, as state_dtype=BF16
    assert (t.optimizer.clip, t.optimizer.clip_pass) == ("exact", "replay")
    t.optimizer.detach()
    ForgeAdamW(model.parameters(), model=model, foreach=True, fused=False, amsgrad=False).detach()  # torch's choices
    with pytest.raises(ValueError, match="amsgrad=True"):
        ForgeAdamW(model.parameters(), model=model, amsgrad=True)
    with pytest.raises(TypeError, match="'betas2'"):
        ForgeAdamW(model.parameters(), model=model, betas2=0.9)


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5], ids=["no_clip", "exact_clip"])
def test_the_chunked_head_used_twice_before_one_backward_equals_torch(max_grad_norm):
    # two losses through the chunked head, or the plain lm_head (logits) and then the chunked head, before one backward
    model = memgrad_hf.patch_model(tiny_model("llama"))
    ref = memgrad_hf.patch_model(tiny_model("llama"))  # the same head math: what differs is the optimizer
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    a, b = torch.randint(1, 100, (2, 8)), torch.randint(1, 100, (2, 8))

    def loss_of(m, step):
        if step % 2:
            return m(input_ids=a, labels=a).loss + 0.5 * m(input_ids=b, labels=b).loss
        return m(input_ids=a).logits.square().mean() + m(input_ids=b, labels=b).loss

    for step in range(4):
        _step_both(model, opt, ref, ref_opt, lambda m, s=step: loss_of(m, s), max_grad_norm)
    _assert_weights_close(model, ref, rtol=5e-5 if max_grad_norm else 1e-6)


@pytest.mark.parametrize("head", [False, True], ids=["plain", "patched_head"])
def test_a_skipped_batch_whose_graph_is_still_held_changes_nothing(head):
    # `loss = model(...).loss; continue`: the old graph is alive during the next forward, which looks like a second use
    model, ref = tiny_model("llama"), tiny_model("llama")
    if head:
        memgrad_hf.patch_model(model)
        memgrad_hf.patch_model(ref)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for m, o in ((model, opt), (ref, ref_opt)):
        g.manual_seed(0)
        for step in range(4):
            ids = torch.randint(1, 100, (2, 8), generator=g)
            loss = m(input_ids=ids, labels=ids).loss
            if step == 1:
                continue  # skipped: no backward
            loss.backward()
            o.step()
            o.zero_grad()
    _assert_weights_close(model, ref, rtol=1e-6)
    assert not opt._shared  # marks found at forward hold for their step only


def test_a_micro_batch_without_target_tokens_is_one_plain_update():
    # the chunked head's zero-token loss reaches lm_head through autograd (no layer backward): one update, no mark
    model = memgrad_hf.patch_model(tiny_model("llama"))
    ref = memgrad_hf.patch_model(tiny_model("llama"))
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(1, 100, (2, 8), generator=g)
        labels = torch.full_like(ids, -100) if step == 1 else ids
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=labels, num_items_in_batch=14).loss.backward()  # (as under accumulation)
            o.step()
            o.zero_grad()
    _assert_weights_close(model, ref, rtol=1e-6)
    assert not opt._warned_shared


class _PenaltyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kw):
        loss = super().compute_loss(model, inputs, return_outputs, **kw)
        return loss + 0.05 * model.model.layers[0].self_attn.q_proj.weight.square().sum()


def test_trainer_with_a_penalty_on_a_linear_weight_equals_adamw_torch(tmp_path):
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    runs = []
    for m, optim in ((model, "forge_adamw"), (ref, "adamw_torch")):
        t = _PenaltyTrainer(model=m, args=_args(tmp_path / optim, optim, max_grad_norm=1.0), train_dataset=_data())
        t.train()
        runs.append([h["loss"] for h in t.state.log_history if "loss" in h])
    assert runs[0] == pytest.approx(runs[1], rel=1e-5)
    _assert_weights_close(model, ref)


class _Interrupt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise KeyboardInterrupt  # Ctrl-C in a notebook


def _plain(model):
    """The model back-propagates normally: every trainable weight gets a .grad, and no layer runs FORGE's forward."""
    model.zero_grad(set_to_none=True)
    ids = torch.arange(1, 9)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    ok = all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    return ok and not hasattr(model, "_memgrad_forge_optimizer")


def test_an_interrupted_train_detaches_forge_and_a_later_trainer_trains_like_stock(tmp_path):
    model = tiny_model("llama")
    trainer = Trainer(model=model, args=_args(tmp_path / "a", "forge_adamw"), train_dataset=_data(),
                      callbacks=[_Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert _plain(model)
    ref = copy.deepcopy(model)
    _, la, ga = _train(model, _args(tmp_path / "b", "adamw_torch"))
    _, lb, gb = _train(ref, _args(tmp_path / "c", "adamw_torch"))
    assert la == pytest.approx(lb, rel=1e-6) and ga == pytest.approx(gb, rel=1e-6) and min(ga) > 0
    _assert_weights_close(model, ref)


def test_a_forge_optimizer_left_attached_by_a_loop_is_detached_by_a_trainer_with_another_optimizer(tmp_path, caplog):
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ids = torch.arange(1, 9)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.detach()
    ref = copy.deepcopy(model)
    opt.attach()  # the loop ends without opt.detach()
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        _, la, _ = _train(model, _args(tmp_path / "a", "adamw_torch"))
    assert "without detach()" in caplog.text and not opt._attached
    _, lb, _ = _train(ref, _args(tmp_path / "b", "adamw_torch"))
    assert la == pytest.approx(lb, rel=1e-6)
    _assert_weights_close(model, ref)


@pytest.mark.parametrize("max_grad_norm,optim_args,warned", [(0.0, None, True), (1.0, "clip=previous", True),
                                                             (1.0, None, False)])
def test_auto_find_batch_size_without_exact_clipping_is_warned_about(tmp_path, caplog, max_grad_norm, optim_args,
                                                                    warned):
    # an OOM inside backward retries with a smaller batch; without the norm pass some layers were updated already
    args = _args(tmp_path, "forge_adamw", auto_find_batch_size=True, max_grad_norm=max_grad_norm,
                 optim_args=optim_args)
    trainer = Trainer(model=tiny_model("llama"), args=args, train_dataset=_data())
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        trainer.create_optimizer()
    assert ("auto_find_batch_size" in caplog.text) == warned
    trainer.optimizer.detach()


def test_auto_find_batch_size_retry_after_an_oom_in_backward_equals_adamw_torch(tmp_path, caplog):
    # an OOM raised in the middle of the first backward at batch 4: the Trainer retries at a smaller batch while the
    # failed attempt's graph may still be alive. Its uses are not second uses (no "used more than once" warning), and
    # with exact clipping the failed attempt changed nothing
    models = {}
    for optim in ("forge_adamw", "adamw_torch"):
        model, fired = tiny_model("llama"), []

        def raise_once(mod, inp, out, fired=fired):
            hidden = out[0] if isinstance(out, tuple) else out
            if hidden.requires_grad and hidden.shape[0] == 4 and not fired:
                def oom(_):
                    fired.append(True)
                    raise torch.OutOfMemoryError("CUDA out of memory. (simulated, in backward)")
                hidden.register_hook(oom)

        model.model.layers[0].register_forward_hook(raise_once)
        args = _args(tmp_path / optim, optim, auto_find_batch_size=True, per_device_train_batch_size=4,
                     max_grad_norm=1.0)
        with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
            Trainer(model=model, args=args, train_dataset=_data()).train()
        assert fired, optim
        models[optim] = model
    assert "more than once" not in caplog.text
    _assert_weights_close(models["forge_adamw"], models["adamw_torch"])


@pytest.mark.parametrize("how", ["instance", "cls_and_kwargs", "cls_and_model"])
def test_a_ready_made_forge_optimizer_clips_at_the_trainers_max_grad_norm(tmp_path, how):
    # Trainer clips any optimizer's gradients at args.max_grad_norm; FORGE's own default is 0 (no clipping)
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    args = _args(tmp_path / "a", "adamw_torch", max_grad_norm=0.5, weight_decay=0.0)
    kw = dict(lr=args.learning_rate, weight_decay=0.0)
    if how == "instance":
        extra = dict(optimizers=(ForgeAdamW(model.parameters(), model=model, **kw), None))
    else:
        extra = dict(optimizer_cls_and_kwargs=(ForgeAdamW, {**kw, ("model" if how == "cls_and_model" else
                                                                  "forge_model"): model}))
    trainer = Trainer(model=model, args=args, train_dataset=_data(), **extra)
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    _, lb, gb = _train(ref, _args(tmp_path / "b", "adamw_torch", max_grad_norm=0.5, weight_decay=0.0))
    assert max(gb) > 0.5  # clipping is active
    assert [h["loss"] for h in hist] == pytest.approx(lb, rel=1e-5)
    assert [h["grad_norm"] for h in hist] == pytest.approx(gb, rel=1e-5)
    _assert_weights_close(model, ref)
    if how == "instance":  # handed back to a hand-written loop with its own norm (it kept the Trainer's 0.5)
        assert trainer.optimizer.optimizer.max_grad_norm == 0.0


@pytest.mark.parametrize("second", [0.0, 2.0])
def test_max_grad_norm_changed_between_two_trains_applies_as_with_adamw_torch(tmp_path, second):
    # The Trainer clips its optimizer at args.max_grad_norm as it is at each step; FORGE kept the value it was built
    # with when it went up or to 0 (weights 2.8e-2 apart after the second train())
    models = [tiny_model("llama"), tiny_model("llama")]
    for model, optim in zip(models, ("forge_adamw", "adamw_torch"), strict=True):
        trainer = Trainer(model=model, args=_args(tmp_path / optim, optim, max_grad_norm=0.5, max_steps=2),
                          train_dataset=_data())
        trainer.train()
        trainer.args.max_grad_norm = second
        trainer.train()
        if optim == "forge_adamw":
            assert trainer.optimizer.optimizer.max_grad_norm == second
    _assert_weights_close(*models)


def test_a_ready_made_forge_optimizer_keeps_accelerates_autocast_over_two_trains(tmp_path):
    # detaching must not remove a forward wrapper installed over FORGE's own (accelerate's bf16 autocast)
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3, max_grad_norm=1.0)
    trainer = Trainer(model=model, args=_args(tmp_path, "adamw_torch", bf16=True, max_steps=2),
                      train_dataset=_data(), optimizers=(opt, None))
    dtypes = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, a, out: dtypes.append(out.dtype) if m.training else None)
    trainer.train()
    trainer.train()
    assert len(dtypes) == 4 and set(dtypes) == {torch.bfloat16}, dtypes
    assert not opt._attached and not opt._trainer_managed  # handed back for hand-written use


def _accelerate_pair(max_grad_norm: float):
    """A tiny Llama with ForgeAdamW prepared by accelerate, and a copy of it with torch's AdamW (lr 1e-2 both)."""
    from accelerate import Accelerator

    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    acc = Accelerator(cpu=True)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=max_grad_norm)
    model, opt = acc.prepare(model, opt)
    return model, opt, acc, ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)


def test_accelerate_loop_clipping_through_the_optimizer_and_clip_grad_norm_warns(caplog):
    # a hand-written accelerate loop: clipping is the optimizer's (max_grad_norm=...); clip_grad_norm_ cannot clip
    # gradients that were applied inside backward, and says so
    model, opt, acc, ref, ref_opt = _accelerate_pair(max_grad_norm=0.5)
    norms = []
    for step in range(3):
        ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
            acc.clip_grad_norm_(model.parameters(), 1.0)  # habit from torch loops: warned about once
        opt.step()
        opt.zero_grad()
        norms.append(opt.optimizer.last_grad_norm)
        ref(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    assert caplog.text.count("does nothing with ForgeAdamW") == 1
    assert min(norms) > 0.5
    _assert_weights_close(model, ref)
    opt.optimizer.detach()


@pytest.mark.parametrize("patched_head", [False, True])
def test_input_gradients_and_partial_backwards_leave_the_weights_alone(patched_head):
    # torch.autograd.grad / backward(inputs=...) accumulate into no weight, so a torch optimizer would see no
    # gradient: FORGE applies no step there either (it stepped every fused layer: an FGSM loop was 0.76 off and
    # counted 8 steps for 4); autograd.grad on parameters gets their real gradients; create_graph is refused
    model = tiny_model("llama")
    if patched_head:  # the reference too: the perturbation amplifies the heads' rounding differences
        memgrad_hf.patch_model(model)
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=5e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=5e-3)

    def adversarial_loss(m, ids):  # FGSM-like: the input gradient first, then the loss on the perturbed input
        emb = m.model.embed_tokens(ids).detach().requires_grad_(True)
        (g,) = torch.autograd.grad(m(inputs_embeds=emb, labels=ids).loss, emb)
        return m(inputs_embeds=(emb + 10.0 * g).detach(), labels=ids).loss  # (sign() would amplify rounding)

    for step in range(3):
        ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step))
        adversarial_loss(model, ids).backward()
        opt.step()
        adversarial_loss(ref, ids).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_weights_close(model, ref)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert opt.state[q]["step"] == 3
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    emb = model.model.embed_tokens(ids).detach().requires_grad_(True)
    model(inputs_embeds=emb, labels=ids).loss.backward(inputs=[emb])
    assert emb.grad is not None and all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, params)
    theirs = torch.autograd.grad(ref(input_ids=ids, labels=ids).loss, [p for p in ref.parameters() if p.requires_grad])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and opt.state[q]["step"] == 3
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(model(input_ids=ids, labels=ids).loss, params[1], create_graph=True)
    opt.detach()


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_a_deep_copy_of_a_model_in_training_is_a_plain_model(max_grad_norm):
    # an EMA / teacher / reference copy made while FORGE is attached: the copy carried a copy of the optimizer and
    # its state (2x the copy's weights) and crashed in its first forward with grad; a FORGE optimizer created on the
    # copy detached the original's. With the model's forward wrapped (the loss's root), the copy ran the original
    # model's forward (its own parameters got no gradient)
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=max_grad_norm)
    twin = copy.deepcopy(model)
    assert not any(isinstance(v, torch.optim.Optimizer) for m in twin.modules() for v in vars(m).values())
    ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(0))
    loss = twin(input_ids=ids, labels=ids).loss
    loss.backward()  # ordinary gradients in the copy, nothing applied to it or to the original
    assert twin.model.layers[0].mlp.up_proj.weight.grad is not None and not opt.state
    twin_opt = ForgeAdamW(twin.parameters(), model=twin, lr=1e-2)
    assert opt._attached and twin_opt._attached
    ref = copy.deepcopy(twin)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for m, o in ((model, opt), (ref, ref_opt)):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()
        if o is ref_opt and max_grad_norm:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        o.step()
    _assert_weights_close(model, ref)  # the original still trains with its own optimizer
    twin_opt.detach()
    opt.detach()


def test_two_forge_optimizers_on_disjoint_parts_of_one_model_are_refused():
    # (the second silently detached the first: half of a GAN never trained) ; model=<submodule> for each is the way
    model = tiny_model("llama")
    first = ForgeAdamW(model.model.layers[0].parameters(), model=model, lr=1e-2)
    with pytest.raises(ValueError, match="model=G"):
        ForgeAdamW(model.model.layers[1].parameters(), model=model, lr=1e-2)
    assert first._attached
    first.detach()
    a = ForgeAdamW(model.model.layers[0].parameters(), model=model.model.layers[0], lr=1e-2)
    b = ForgeAdamW(model.model.layers[1].parameters(), model=model.model.layers[1], lr=1e-2)
    assert a._attached and b._attached
    a.detach()
    b.detach()


def test_gradient_hooks_on_fused_weights_see_the_whole_gradient():
    # the "train only the new token rows" recipe: a tensor hook masks the gradient. Fused weights bypassed their
    # hooks (masked rows changed; a hook written g * mask crashed on None after the update had happened)
    model = tiny_model("llama")
    memgrad_hf.patch_model(model)  # the chunked head's block-wise update is bypassed for a hooked head too
    ref = copy.deepcopy(model)
    rows = {"model.embed_tokens.weight": 95, "model.layers.0.mlp.up_proj.weight": 8, "lm_head.weight": 90}
    for m in (model, ref):
        for name, n in rows.items():
            w = m.get_parameter(name)
            mask = torch.zeros(w.shape[0], 1)
            mask[n:] = 1.0
            w.register_hook(lambda g, mask=mask: g * mask)
    before = {n: model.get_parameter(n).detach().clone() for n in rows}
    opt = ForgeAdamW(model.parameters(), model=model, lr=5e-3, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=5e-3, weight_decay=0.0)
    for step in range(2):
        ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step))
        _step_both(model, opt, ref, ref_opt, lambda m, ids=ids: m(input_ids=ids, labels=ids).loss)
    _assert_weights_close(model, ref)
    for name, n in rows.items():
        w = model.get_parameter(name)
        assert torch.equal(w[:n], before[name][:n]) and not torch.equal(w[n:], before[name][n:]), name
    opt.detach()


def test_options_that_change_the_result_are_refused_however_they_arrive():
    # amsgrad / maximize were refused in the constructor only: in a param group or a loaded torch state dict they
    # were silently ignored (0.22 off with maximize); Lion's state loaded into AdamW failed inside backward;
    # a positional lr became the model; sparse embedding gradients failed deep in a norm
    from memgrad_hf.optim import ForgeLion

    model = tiny_model("llama")
    with pytest.raises(TypeError, match="pass the learning rate by keyword"):
        ForgeAdamW(model.parameters(), 1e-3)
    opt = ForgeAdamW(model.parameters(), model=model)
    with pytest.raises(ValueError, match="maximize=True"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "maximize": True})
    with pytest.raises(ValueError, match="maximize=True"):
        ForgeAdamW([{"params": model.parameters(), "maximize": True}], model=model)
    ref = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(ref.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.load_state_dict(torch_opt.state_dict())
    lion_model = copy.deepcopy(ref)
    lion = ForgeLion(lion_model.parameters(), model=lion_model)
    ids = torch.randint(1, 101, (2, 10))
    lion_model(input_ids=ids, labels=ids).loss.backward()
    lion.step()
    with pytest.raises(ValueError, match="another optimizer"):
        opt.load_state_dict(lion.state_dict())
    # the other way round Lion kept AdamW's second moment as dead state, which it saved again (a later AdamW took it
    # as its own); SGD took AdamW's groups and failed with KeyError 'momentum' inside the next backward
    from memgrad_hf.optim import ForgeSGD

    lion_model(input_ids=ids, labels=ids).loss.backward()  # (lion: a second step, opt: a first, with state)
    lion.detach()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with pytest.raises(ValueError, match="another optimizer"):
        lion.load_state_dict(opt.state_dict())
    opt.detach()
    sgd = ForgeSGD(lion_model.parameters(), model=lion_model, momentum=0.9)
    for saved in (opt.state_dict(), {"state": {}, "param_groups": opt.state_dict()["param_groups"]}):
        with pytest.raises(ValueError, match="another optimizer"):
            sgd.load_state_dict(saved)
    sgd.detach()
    emb = nn.Embedding(10, 4, sparse=True)
    with pytest.raises(ValueError, match="sparse=True"):
        ForgeAdamW(emb.parameters(), model=emb)


def _backward_and_step(model, opt, steps: int) -> None:
    """``steps`` plain-loop steps on random ids: backward, then ``opt.step()``."""
    for _ in range(steps):
        ids = torch.randint(1, 101, (2, 10))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def test_step_while_accelerate_says_no_sync_warns(caplog):
    # a stale GradientState (an accelerator.accumulate() block interrupted mid-way) left a later hand-written loop
    # accumulating into .grad forever, without a word
    from accelerate.state import GradientState

    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    GradientState()._set_sync_gradients(False)
    try:
        with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
            _backward_and_step(model, opt, 2)
        assert caplog.text.count("does not sync") == 1 and not opt.state
    finally:
        GradientState()._set_sync_gradients(True)
        opt.detach()


def test_step_while_sync_is_left_false_warns_once(caplog):
    # optimizer.sync = False (own-loop accumulation) never set back: every backward went into .grad, no weight moved
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    opt.sync = False
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        _backward_and_step(model, opt, 3)
    assert caplog.text.count("optimizer.sync = False") == 1 and not opt.state
    opt.detach()


def test_a_grad_scaler_with_forge_is_refused_before_any_update():
    # scaler.scale(loss).backward() applied the 65536x-scaled gradient inside backward (lm_head moved by 7.4)
    model = tiny_model("llama")
    before = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    ids = torch.randint(1, 101, (2, 10))
    with pytest.raises(ValueError, match="Remove the GradScaler"):
        scaler.scale(model(input_ids=ids, labels=ids).loss)
    _assert_weights_close(model, before, rtol=0)
    opt.detach()
    scaler.scale(model(input_ids=ids, labels=ids).loss)  # detached: the scaler is the user's business again


def test_forge_model_spelling_in_a_hand_written_loop_clips_exactly():
    # PEFT's create_loraplus_optimizer(model, cls, ...) takes `model` itself, so LoRA+ passes forge_model=: that
    # spelling was taken for the Trainer's, left the model's forward unwrapped, and exact clipping then failed in
    # backward ("needs the loss to come from model(...)"), though it did
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if "up_proj" in n], "lr": 5e-2},
              {"params": [p for n, p in named if "up_proj" not in n]}]
    opt = ForgeAdamW(groups, forge_model=model, lr=1e-2, max_grad_norm=0.5)
    rnamed = list(ref.named_parameters())
    ref_opt = torch.optim.AdamW([{"params": [p for n, p in rnamed if "up_proj" in n], "lr": 5e-2},
                                 {"params": [p for n, p in rnamed if "up_proj" not in n]}], lr=1e-2)
    for step in range(3):
        ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            if o is ref_opt:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            o.step()
            o.zero_grad()
    opt.detach()
    _assert_weights_close(model, ref)


def test_a_backward_that_raised_loses_no_later_update():
    # The raising backward's root stayed set; a later backward without a root (its loss computed from .logits)
    # deferred every hooked update, and step() dropped them (the norms never trained)
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    armed = {"on": True}

    def fail_once(module, grad_out):
        if armed["on"]:
            armed["on"] = False
            raise RuntimeError("simulated out-of-memory")

    handle = model.lm_head.register_full_backward_pre_hook(fail_once)  # before any update of this backward
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="simulated"):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.zero_grad()
    for step in range(2):
        ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step + 1))
        for m, o in ((model, opt), (ref, ref_opt)):
            logits = m(input_ids=ids).logits
            nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
            o.step()
            o.zero_grad()
    handle.remove()
    opt.detach()
    _assert_weights_close(model, ref)


def test_accelerate_loop_with_forge_model_clips_a_loss_computed_outside_the_model():
    # forge_model= no longer means Trainer-managed; Accelerator.backward roots any loss of an attached FORGE
    # optimizer it prepared (a loss from .logits had no root: "needs the loss to come from model(...)")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    weights = []
    for kind in ("forge", "torch"):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        model = tiny_model("llama")
        acc = Accelerator(cpu=True)
        opt = (ForgeAdamW(model.parameters(), forge_model=model, lr=1e-2, max_grad_norm=0.05) if kind == "forge"
               else torch.optim.AdamW(model.parameters(), lr=1e-2))
        pm, popt = acc.prepare(model, opt)
        for step in range(3):
            ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step))
            logits = pm(input_ids=ids).logits
            acc.backward(nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
            if kind == "torch":
                acc.clip_grad_norm_(pm.parameters(), 0.05)
            popt.step()
            popt.zero_grad()
        if kind == "forge":
            opt.detach()
        weights.append(model)
    _assert_weights_close(*weights)


def test_torch_clip_grad_norm_in_a_hand_written_loop_is_warned_about_once(caplog):
    # the torch idiom finds no .grad (each update was applied inside backward) and silently clipped nothing
    model = tiny_model("llama")
    ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(0))
    for max_grad_norm, said in ((0.0, 1), (1.0, 0)):  # the optimizer's own clipping at that norm: nothing to say
        caplog.clear()
        opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3, max_grad_norm=max_grad_norm)
        with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
            for _ in range(2):
                opt.backward(model(input_ids=ids, labels=ids).loss)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        opt.detach()
        assert caplog.text.count("torch.nn.utils.clip_grad_norm_(max_norm=1.0) does nothing with ForgeAdamW") == said


def test_torch_clipping_imported_by_another_name_is_warned_about_or_refused(caplog):
    # `from torch.nn.utils import clip_grad_norm_` before `import memgrad_hf` holds torch's own function (as does
    # torch.nn.utils.clip_grad.clip_grad_norm_): it clipped nothing without a word; clip_grad_value_ raised torch's
    # internal "Expected !nested_tensorlist[0].empty()"
    import torch.nn.utils.clip_grad as torch_clip

    model = tiny_model("llama")
    ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(0))
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            torch_clip.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert caplog.text.count("clip_grad_norm_(max_norm=1.0) does nothing with ForgeAdamW") == 1
    model(input_ids=ids, labels=ids).loss.backward()
    for clip_value in (torch.nn.utils.clip_grad_value_, torch_clip.clip_grad_value_):
        with pytest.raises(ValueError, match="clip_grad_value_ .* ForgeAdamW.*max_grad_norm"):
            clip_value(model.parameters(), 0.5)
    opt.detach()
    model(input_ids=ids, labels=ids).loss.backward()  # detached: torch's functions as they are
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.5


def test_a_training_step_override_calling_loss_backward_is_told_to_use_accelerator_backward(tmp_path):
    # Under the Trainer exact clipping enters through Accelerator.backward; an older custom training_step calling
    # loss.backward() was told its loss must "come from model(...)", which it did, and not the fix
    class PlainBackward(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            loss.backward()
            return loss.detach()

    model = tiny_model("llama")
    before = copy.deepcopy(model)
    trainer = PlainBackward(model=model, args=_args(tmp_path, "forge_adamw", max_grad_norm=1.0),
                            train_dataset=_data())
    with pytest.raises(RuntimeError, match=r"call self\.accelerator\.backward\(loss\)"):
        trainer.train()
    _assert_weights_close(model, before, rtol=0.0)  # nothing was updated


def test_parameters_left_to_another_optimizer_get_one_gradient_under_a_norm_only_backward():
    # own loop, FORGE on the decoder layers only, clip_pass="backward": the norm-only backward's gradients of the
    # embeddings / head / final norm (another optimizer's) stayed in .grad and the update backward added its own (2x)
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.model.layers.parameters(), model=model, lr=1e-3, max_grad_norm=100.0, clip_pass="backward")
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        got, want = model.get_parameter(name).grad, ref.get_parameter(name).grad
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), name
    opt.detach()


def test_forge_sgd_takes_the_model_as_params_and_continues_a_torch_sgd_state():
    # ForgeSGD(model, lr=...) failed ('Net' object is not iterable); a torch SGD state (momentum_buffer, no step)
    # loaded, then failed at the next backward with KeyError: 'step'
    model = tiny_model("llama")
    assert len(ForgeSGD(model, lr=1e-2).param_groups[0]["params"]) == len(list(model.parameters()))
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    torch_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    for _ in range(2):
        ref(input_ids=ids, labels=ids).loss.backward()
        torch_opt.step()
        torch_opt.zero_grad()
    model.load_state_dict(ref.state_dict())
    opt = ForgeSGD(model.parameters(), model=model, lr=1e-2, momentum=0.9)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for _ in range(2):
        for m, o in ((model, opt), (ref, torch_opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    _assert_weights_close(model, ref)
    opt.detach()


@pytest.mark.parametrize("opt_cls", [ForgeAdamW, ForgeSGD])
def test_a_sparse_embedding_is_refused_at_construction(opt_cls):
    # in backward it failed after the other layers had stepped (and, under clipping, with torch's "Could not run
    # 'aten::linalg_vector_norm'"); ForgeSGD's message claimed torch's SGD had no sparse gradients either
    net = nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"0 is nn.Embedding\(sparse=True\)"):
        opt_cls(net.parameters(), model=net, lr=1e-3, max_grad_norm=0.5)
    net[0].weight.requires_grad_(False)  # a frozen one is no concern
    opt_cls(net.parameters(), model=net, lr=1e-3).detach()
    # the backward check stays for one unfrozen later
    opt = opt_cls(net.parameters(), model=net, lr=1e-3)
    net[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.backward(net(torch.tensor([[1, 2, 3]])).sum())
    opt.detach()


def test_clip_grad_norm_at_the_optimizers_norm_returns_the_norm_it_measured(caplog):
    # the recommended loop (the optimizer clips at max_grad_norm, the loop keeps its clip call to log the norm)
    # logged 0.0 at every step: no .grad is left after backward
    model, opt, acc, ref, ref_opt = _accelerate_pair(max_grad_norm=1.0)
    for step in range(2):
        ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        got = (acc.clip_grad_norm_(model.parameters(), 1.0), torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        for g in got:
            assert g.item() == pytest.approx(want.item(), rel=1e-5), step
        with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
            inf = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
        assert inf.item() == 0.0  # another norm than the one measured: the usual result (no .grad), said once
        assert caplog.text.count("norm_type=inf) does nothing") == 1, caplog.text
        head = torch.nn.utils.clip_grad_norm_(model.lm_head.parameters(), 1.0)
        assert head.item() == 0.0  # a part of the model: not FORGE's norm, which is over all of it
    opt.optimizer.detach()


def test_clip_grad_norm_on_a_micro_batch_that_does_not_sync_measures_dot_grad():
    # accumulation keeps the partial sum in .grad on non-sync micro-batches: a clip call there got the previous
    # step's measured norm instead of the norm of what it clips
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=1.0)
    for step, sync in enumerate((True, False, True)):  # a whole step first: a measured norm exists
        ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step))
        opt.sync = sync
        opt.backward(model(input_ids=ids, labels=ids).loss)
        if not sync:
            want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                         if p.grad is not None]))
            assert want.item() != pytest.approx(opt.last_grad_norm, rel=1e-3)
            got = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert got.item() == pytest.approx(want.item(), rel=1e-6)
        else:
            opt.step()
    opt.detach()


def test_clip_grad_norm_with_the_previous_steps_norm_is_warned_about(caplog):
    # clip="previous" measures this step's norm only in step(): the call returns 0, and said nothing
    model = tiny_model("llama")
    ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(0))
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3, max_grad_norm=1.0, clip="previous")
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    opt.detach()
    assert "does nothing with ForgeAdamW" in caplog.text


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "8bit"])
def test_a_checkpoint_whose_state_does_not_fit_the_parameters_is_refused(state_dtype):
    # another model's checkpoint (or the parameters in another order) was taken: the next backward wrote out of
    # bounds (segfault, glibc abort) with bf16 / 8-bit state, and transposed state of equal size trained silently
    def model_and_opt(order):
        a, b = nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False)
        model = nn.Sequential(a, b)
        params = [a.weight, b.weight] if order == "ab" else [b.weight, a.weight]
        return model, ForgeAdamW(params, model=model, state_dtype=state_dtype)

    model, opt = model_and_opt("ab")
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    opt.detach()
    other, other_opt = model_and_opt("ba")
    with pytest.raises(ValueError, match="belongs to another model"):
        other_opt.load_state_dict(saved)
    other_opt.detach()
    bigger = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False), nn.Linear(64, 64))
    bigger_opt = ForgeAdamW(bigger.parameters(), model=bigger, state_dtype=state_dtype)  # e.g. memory added
    with pytest.raises(ValueError, match=r"groups of \[2\] parameters, this one \[4\]"):
        bigger_opt.load_state_dict(saved)
    bigger_opt.detach()
    again, again_opt = model_and_opt("ab")
    torch.optim.lr_scheduler.LambdaLR(again_opt, lambda step: 1.0)  # (its initial_lr is no hyperparameter to match)
    again_opt.load_state_dict(saved)  # the same layout loads
    again_opt.detach()


@pytest.mark.parametrize("head", [False, True], ids=["plain", "patched_head"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_weight_resized_after_its_state_was_made_is_refused_before_any_update(head, tied):
    # resize_token_embeddings swaps the embedding's data in place: the next backward failed deep in the update with a
    # bare size mismatch, after updating most of the model (a half-applied step)
    model = tiny_model("llama", tied=tied)
    if head:
        memgrad_hf.patch_model(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    vocab = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(vocab + 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.shape[0] != vocab + 2}
    with pytest.raises(ValueError, match="resize_token_embeddings"):
        model(input_ids=ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n
    # a new optimizer trains the resized model
    opt.detach()
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


class _OutsideUseNet(nn.Module):
    """A linear weight used by its layer and outside it (``F.linear`` on the same weight)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.e, self.a, self.o = nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10)

    def forward(self, x):
        h = self.e(x)
        return self.o(self.a(h) + 0.5 * nn.functional.linear(h, self.a.weight))


@pytest.mark.parametrize("opt_cls", [ForgeSGD, ForgeAdamW])
def test_a_weight_used_outside_its_layer_and_frozen_at_the_first_backward_is_updated_once_after_unfreezing(opt_cls):
    # the graph scan that finds a second use ran once per attach: a weight frozen then had no edge in the graph, so
    # once unfrozen its layer's part and the outside part were applied as two updates (1.6x torch's SGD step)
    kw = {"lr": 1.0, "momentum": 0.9} if opt_cls is ForgeSGD else {"lr": 1e-2}
    model = _OutsideUseNet()
    ref = copy.deepcopy(model)
    ref_opt = (torch.optim.SGD if opt_cls is ForgeSGD else torch.optim.AdamW)(ref.parameters(), **kw)
    opt = opt_cls(model.parameters(), model=model, **kw)
    x = torch.randint(0, 10, (3, 4), generator=torch.Generator().manual_seed(1))

    def loss(m):
        return nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())

    for frozen in (True, False, False):
        for m in (model, ref):
            m.a.weight.requires_grad_(not frozen)
        ref_opt.zero_grad()
        loss(ref).backward()
        ref_opt.step()
        opt.backward(loss(model))
        opt.step()
        _assert_weights_close(model, ref)
    assert opt.state[model.a.weight]["step"].item() == 2
    opt.detach()


def test_a_grad_held_before_the_optimizer_exists_is_warned_about_and_zero_grad_makes_it_torch(caplog):
    """FORGE's loop has no zero_grad: a .grad left from a backward before the optimizer existed would join the first
    update silently (0.066 off torch after 3 steps, found by a user switching PEFT adapters)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    (model(x) - y).pow(2).mean().backward()  # e.g. a sanity check before training
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        opt = ForgeAdamW(model.parameters(), model=model, lr=0.1)
    assert "4 parameters already hold a .grad" in caplog.text and "zero_grad()" in caplog.text
    opt.zero_grad()  # the advice
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for _ in range(3):
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        (ref(x) - y).pow(2).mean().backward()
        ref_opt.step()
    opt.detach()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    caplog.clear()
    ref_opt.zero_grad()  # (set_to_none: nothing held)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        ForgeAdamW(ref.parameters(), model=ref, lr=0.1).detach()
    assert "already hold a .grad" not in caplog.text


class _TwoHeads(nn.Module):
    """A body and two task heads: a micro-batch of task "a" never reaches head_b, and the other way round."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head_a, self.head_b = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, x, y, task):
        head = self.head_a if task == "a" else self.head_b
        return nn.functional.cross_entropy(head(torch.tanh(self.body(x))), y)


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
@pytest.mark.parametrize("rule", ["sgd", "adamw"])
def test_accumulated_gradients_of_parameters_the_last_micro_batch_misses_are_applied(rule, max_grad_norm):
    # accumulation where the sync micro-batch does not reach every parameter (a task head, an MoE expert): torch steps
    # them from their accumulated .grad, and clips by the norm over all of them; FORGE left them waiting in .grad
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(6)]
    forge_cls, torch_cls, kw = ((ForgeSGD, torch.optim.SGD, dict(lr=0.5)) if rule == "sgd"
                                else (ForgeAdamW, torch.optim.AdamW, dict(lr=1e-2)))
    a, b = _TwoHeads(), _TwoHeads()
    fo, to = forge_cls(a.parameters(), model=a, max_grad_norm=max_grad_norm, **kw), torch_cls(b.parameters(), **kw)
    for step in range(3):
        (x1, y1), (x2, y2) = data[2 * step], data[2 * step + 1]
        fo.sync = False
        a(x1, y1, "a").backward()
        fo.sync = True
        a(x2, y2, "b").backward()
        fo.step()
        to.zero_grad()
        b(x1, y1, "a").backward()
        b(x2, y2, "b").backward()
        if max_grad_norm:
            norm = torch.nn.utils.clip_grad_norm_(b.parameters(), max_grad_norm)
            assert fo.last_grad_norm == pytest.approx(norm.item(), rel=1e-5)
        to.step()
    fo.detach()
    assert all(p.grad is None for p in a.parameters())
    _assert_weights_close(a, b)


def test_a_second_clipped_backward_before_step_is_warned_about(caplog):
    # each opt.backward() with exact clipping clips by its own norm; torch clips the sum once at step()
    model = _TwoHeads()
    opt = ForgeSGD(model.parameters(), model=model, lr=0.1, max_grad_norm=0.1)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.forge"):
        opt.backward(model(x, y, "a"))
        assert "second backward with exact clipping" not in caplog.text
        opt.backward(model(x, y, "b"))
    assert "second backward with exact clipping" in caplog.text and "sync = False" in caplog.text
    opt.step()
    opt.detach()


def test_layers_under_accelerates_dispatch_hooks_are_fused_and_exact():
    # device_map over several devices puts accelerate's hook on every module with weights: the fused forward was
    # skipped there (an instance forward: "someone else owns it"), every weight fell back to the hook path unsaid
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_module

    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    model = dispatch_model(model, device_map=device_map, force_hooks=True)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    linears = [m for m in model.modules() if type(m) in (nn.Linear, nn.Embedding)]
    assert all(hasattr(m, "_hf_hook") for m in linears)
    assert all(hasattr(m, "_memgrad_forge") for m in linears)
    for step in range(3):
        if step == 2:  # the hooks removed under an attached optimizer: the fused forward stays the module's
            remove_hook_from_module(model, recurse=True)
        ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
        assert all(p.grad is None for m in linears for p in m.parameters())  # updated inside backward
    _assert_weights_close(model, ref)
    opt.detach()
    assert not any("forward" in m.__dict__ or hasattr(m, "_memgrad_forge") for m in linears)
    # and detached while the hooks are on: accelerate's hook calls the module's own forward again
    model = dispatch_model(tiny_model("llama"), device_map=device_map, force_hooks=True)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    opt.detach()
    proj = model.model.layers[0].self_attn.q_proj
    assert proj._old_forward.__func__ is nn.Linear.forward and not hasattr(proj, "_memgrad_forge")


def test_offloaded_parameters_are_refused():
    # cpu_offload / disk offload keep weights on the meta device and load a temporary copy per forward: the update
    # went to the copy, training changed nothing and the logged norm was 0, unsaid
    from accelerate import cpu_offload

    model = cpu_offload(tiny_model("llama"))
    with pytest.raises(ValueError, match="meta device"):
        ForgeAdamW(model.parameters(), model=model, lr=1e-2)


class _CachedLoss:
    """GradCache as sentence-transformers' cached losses run it: embeddings computed without a graph, the loss over
    them back-propagated to the embeddings at once (their gradients cached), and a loss returned whose backward runs
    one backward per mini-batch (re-run with a graph) into the model."""

    def __init__(self, model, mini_batch):
        self.model, self.mini_batch = model, mini_batch

    def __call__(self, ids):
        with torch.no_grad():
            reps = torch.cat([self.model(ids[i:i + self.mini_batch]) for i in range(0, len(ids), self.mini_batch)])
        reps = reps.detach().requires_grad_()
        with torch.enable_grad():
            loss = nn.functional.cross_entropy(reps @ reps.t(), torch.arange(len(ids)))
            loss.backward()  # (reaches the embeddings only: no parameter)
        cached = reps.grad
        loss = loss.detach().requires_grad_()

        def backward_minibatches(grad):
            for i in range(0, len(ids), self.mini_batch):
                with torch.enable_grad():
                    out = self.model(ids[i:i + self.mini_batch])
                torch.autograd.backward(out, grad * cached[i:i + self.mini_batch])
            return grad

        loss.register_hook(backward_minibatches)
        return loss


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5], ids=["no_clip", "exact_clip"])
def test_a_cached_loss_backpropagating_mini_batches_inside_its_backward_is_one_update(max_grad_norm):
    # each mini-batch's nested backward applied an update of its own (8 per step, ~12 lr off torch after 2 steps)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(30, 16), nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 8))
    ref = copy.deepcopy(net)
    opt = ForgeAdamW(net.parameters(), model=net, lr=1e-2, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, 30, (8, 4), generator=torch.Generator().manual_seed(step))
        opt.backward(_CachedLoss(net, 2)(ids))
        opt.step()
        loss = _CachedLoss(ref, 2)(ids)
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_weights_close(net, ref)
    opt.detach()


def test_accelerate_hooks_added_or_removed_around_the_optimizer():
    # a hook added after the optimizer was dropped by detach() (and remove_hook_from_module then raised KeyError);
    # layers whose hook was removed before the optimizer was built were left unfused; removing the model's hook
    # under an attached optimizer lost its clipping root, with a message that did not say why
    from accelerate import dispatch_model
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class AddOne(ModelHook):
        def post_forward(self, module, output):
            return output + 1.0

    model = tiny_model("llama")
    proj = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, proj.in_features)
    plain = proj(x)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    add_hook_to_module(proj, AddOne())
    assert torch.allclose(proj(x), plain + 1)
    opt.detach()
    assert torch.allclose(proj(x), plain + 1)  # the hook stays, around the layer's own forward again
    remove_hook_from_module(proj)
    assert torch.allclose(proj(x), plain)

    device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    model = remove_hook_from_module(dispatch_model(tiny_model("llama"), device_map=device_map, force_hooks=True),
                                    recurse=True)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    assert all(hasattr(m, "_memgrad_forge") for m in model.modules() if type(m) in (nn.Linear, nn.Embedding))
    opt.detach()

    model = dispatch_model(tiny_model("llama"), device_map=device_map, force_hooks=True)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=1.0)
    remove_hook_from_module(model, recurse=True)
    ids = torch.randint(1, 101, (2, 10))
    with pytest.raises(RuntimeError, match="no longer runs the wrapper"):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.detach()


def test_memgrads_forward_wrappers_after_accelerates_prepare_unwrap_pickle_and_unpatch(caplog):
    # found with the wrappers' __wrapped__ gone: wrapping after accelerate's bf16 prepare, unwrap_model(
    # keep_fp32_wrapper=False) bound memgrad's bound wrapper twice (TypeError on the next forward); a model with a
    # FORGE optimizer attached could not be pickled (weak references), and its fused layers' forwards would not
    # unpickle; unpatch_model named transformers as the later wrapper of FORGE's; and the exact-clipping error said
    # the optimizer's wrapper was lost when the chunked head merely wrapped it
    import io

    from accelerate import Accelerator

    model = Accelerator(cpu=True, mixed_precision="bf16").prepare(tiny_model("llama"))
    patch_model(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=1.0)
    plain = Accelerator(cpu=True).unwrap_model(model, keep_fp32_wrapper=False)
    ids = torch.randint(1, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    assert plain(input_ids=ids, labels=ids).loss.isfinite()
    opt.detach()

    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=1.0)
    patch_model(model)
    with pytest.raises(RuntimeError, match="needs the loss to come from model") as err:
        model(input_ids=ids).logits.float().mean().backward()  # (a loss outside the model)
    assert "no longer runs the wrapper" not in str(err.value)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    loaded(input_ids=ids, labels=ids).loss.backward()  # plainly: no optimizer came with it
    assert all(p.grad is not None for p in loaded.parameters())
    opt.detach()
    model = patch_model(tiny_model("llama"))
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=1.0)  # (its wrapper around the head's)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        memgrad_hf.unpatch_model(model)
    assert "by memgrad_hf.optim.forge: a FORGE optimizer's exact-clipping wrapper: opt.detach()" in caplog.text
    opt.detach()


def test_autograd_grad_of_the_loss_to_an_input_is_not_a_clipped_backward(caplog):
    # torch.autograd.grad(loss, inputs_embeds) inside the loss (a saliency term) ran a norm pass through the loss's
    # root: the real backward then warned of "a second backward with exact clipping" that did not happen
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def loss_of(m, ids):
        x = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        out = m(inputs_embeds=x, labels=ids)
        torch.autograd.grad(out.loss, x, retain_graph=True)
        return out.loss

    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        for step in range(3):
            ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(step))
            loss_of(model, ids).backward()
            opt.step()
            loss_of(ref, ids).backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            assert opt.last_grad_norm == pytest.approx(want.item(), rel=1e-5)
    assert "second backward" not in caplog.text, caplog.text
    _assert_weights_close(model, ref)
    opt.detach()
