"""ForgeSGD / ``--optim forge_sgd`` against ``torch.optim.SGD`` (fp32): weights and logged losses match."""

import copy

import pytest
import torch
from transformers import Trainer

import memgrad_hf  # noqa: F401  (registers forge_*)
from memgrad_hf.optim import ForgeSGD
from tests.optim.test_forge_trainer import _args, _assert_weights_close, _steps_side_by_side, _train
from tests.test_trainer_integration import _data
from tests.tiny_models import tiny_model


@pytest.mark.parametrize("kw", [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=0.1),
                                dict(momentum=0.8, dampening=0.3, weight_decay=0.05)],
                         ids=["plain", "momentum", "nesterov_wd", "dampening_wd"])
def test_standalone_forge_sgd_equals_torch_sgd(kw):
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    opt = ForgeSGD(model.parameters(), model=model, lr=0.05, **kw)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, foreach=False, **kw)
    assert opt.rule == ("sgd_momentum" if kw.get("momentum") else "sgd")
    ids = torch.randint(1, 100, (2, 8))
    _steps_side_by_side(model, opt, ref, ref_opt, ids, 3)
    _assert_weights_close(model, ref)
    assert all(p.grad is None for p in model.parameters())
    if not kw.get("momentum"):
        assert all(set(st) == {"step"} for st in opt.state.values())  # plain SGD keeps no state


@pytest.mark.parametrize("how", ["one_cycle", "edited_later"])
def test_momentum_given_after_construction_is_used_as_torch_sgd_uses_it(how):
    # OneCycleLR(cycle_momentum=True, its default) sets the groups' momentum; ForgeSGD(momentum=0) kept a rule
    # without momentum state and raised KeyError 'momentum_buffer' inside backward
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    opt = ForgeSGD(model.parameters(), model=model, lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, foreach=False)
    scheds = []
    for o in (opt, ref_opt):
        if how == "one_cycle":
            scheds.append(torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10))
    for step in range(4):
        if how == "edited_later" and step == 2:
            for o in (opt, ref_opt):
                o.param_groups[0]["momentum"] = 0.9
        ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(step))
        _steps_side_by_side(model, opt, ref, ref_opt, ids, 1)
        for s in scheds:
            s.step()
    assert opt.rule == "sgd_momentum"
    _assert_weights_close(model, ref)
    opt.detach()


def test_forge_sgd_in_trainer_equals_torch_sgd_with_momentum_and_clipping(tmp_path):
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    args = _args(tmp_path / "f", "forge_sgd", learning_rate=0.05, max_grad_norm=0.5,
                 optim_args="momentum=0.9,nesterov=true")
    t, la, ga = _train(model, args)
    assert type(t.optimizer.optimizer).__name__ == "ForgeSGD"
    args_r = _args(tmp_path / "r", "sgd", learning_rate=0.05, max_grad_norm=0.5)
    tr = Trainer(model=ref, args=args_r, train_dataset=_data(),
                 optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                                             "foreach": False}))
    tr.train()
    hist = [h for h in tr.state.log_history if "loss" in h]
    assert min(h["grad_norm"] for h in hist) > 0.5  # clipping was active every step
    assert la == pytest.approx([h["loss"] for h in hist], rel=1e-5)
    assert ga == pytest.approx([h["grad_norm"] for h in hist], rel=1e-4)
    _assert_weights_close(model, ref)


def test_forge_sgd_bad_arguments_are_refused(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="nesterov"):
        ForgeSGD(model.parameters(), model=model, nesterov=True)
    with pytest.raises(ValueError, match="momentum"):
        ForgeSGD(model.parameters(), model=model, momentum=1.5)
    with pytest.raises(ValueError, match="momentum=F"):
        _train(model, _args(tmp_path, "forge_sgd", optim_args="betas=0.9"))


@pytest.mark.parametrize("state_dtype", ["bf16", "8bit"])
def test_forge_sgd_reduced_precision_momentum_stays_near_fp32(monkeypatch, state_dtype):
    import memgrad_hf.optim.forge as forge_mod

    monkeypatch.setattr(forge_mod, "_MIN_8BIT_NUMEL", 0)  # the tiny model's matrices are below the default
    model = tiny_model("llama")
    ref, start = copy.deepcopy(model), copy.deepcopy(model)
    opts = [ForgeSGD(m.parameters(), model=m, lr=0.05, momentum=0.9, state_dtype=dt)
            for m, dt in ((model, state_dtype), (ref, "fp32"))]
    ids = torch.randint(1, 100, (2, 8))
    for _ in range(3):
        for m, o in zip((model, ref), opts, strict=True):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    want = {"bf16": torch.bfloat16, "8bit": torch.uint8}[state_dtype]  # 8-bit: e3m4 codes as bytes
    assert opts[0].state[model.lm_head.weight]["momentum_buffer"].dtype == want
    for p, q, w0 in zip(model.parameters(), ref.parameters(), start.parameters(), strict=True):
        moved = (q - w0).abs().max().item()
        # the buffer is kept to 2^-4 relative (8-bit, plus a 2^-10 share of its block's scale) or 2^-8 (bf16)
        assert (p - q).abs().max().item() <= 0.1 * moved + 1e-7
