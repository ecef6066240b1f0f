"""FORGE in HF Trainer against torch.optim (fp32): weights, logged losses and grad norms match."""

import copy
import logging
import math
import types

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

import memgrad_hf  # noqa: F401  (registers forge_*)
from memgrad_hf.optim import ForgeAdamW, ForgeSGD, forge_optimizer_of
from tests.test_trainer_integration import _data
from tests.tiny_models import tiny_model


def _args(tmp_path, optim, **kw):
    base = dict(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, learning_rate=5e-3,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, optim=optim, lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.1,
        max_grad_norm=0.0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def _train(model, args):
    t = Trainer(model=model, args=args, train_dataset=_data())
    t.train()
    hist = [h for h in t.state.log_history if "loss" in h]
    return t, [h["loss"] for h in hist], [h.get("grad_norm") for h in hist]


def _assert_weights_close(a, b, rtol=1e-5):
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        err = (p - q).abs().max().item()
        assert err <= rtol * q.abs().max().item() + 1e-7, (n, err)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_forge_adamw_equals_adamw_torch(tmp_path, tied):
    model = tiny_model("llama", tied=tied)
    ref = copy.deepcopy(model)
    t, la, ga = _train(model, _args(tmp_path / "f", "forge_adamw"))
    _, lb, gb = _train(ref, _args(tmp_path / "r", "adamw_torch"))
    assert type(t.optimizer.optimizer).__name__ == "ForgeAdamW"
    assert forge_optimizer_of(t.optimizer) is t.optimizer.optimizer and forge_optimizer_of(t.optimizer.optimizer)
    assert forge_optimizer_of(torch.optim.SGD(ref.parameters(), lr=1.0)) is None
    assert la == pytest.approx(lb, rel=1e-5)
    assert ga == pytest.approx(gb, rel=1e-4)  # the logged norm is the real one, not 0
    _assert_weights_close(model, ref)
    assert all(p.grad is None for p in model.parameters())  # nothing left behind


def _count_linear_backwards(monkeypatch) -> list:
    """Counts the fused linears' backward calls (one per linear layer and backward walk)."""
    from memgrad_hf.optim.fused_linear import ForgeLinearFunction

    calls, real = [], ForgeLinearFunction.backward

    def counted(ctx, dy):
        calls.append(1)
        return real(ctx, dy)

    monkeypatch.setattr(ForgeLinearFunction, "backward", staticmethod(counted))
    return calls


@pytest.mark.parametrize("clip_pass", ["replay", "backward"])
@pytest.mark.parametrize("head_grad", ["recompute", "hold"])
def test_forge_with_patched_head_and_exact_clipping(tmp_path, monkeypatch, head_grad, clip_pass):
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model)
    calls = _count_linear_backwards(monkeypatch)
    _, la, ga = _train(model, _args(tmp_path / "f", "forge_adamw", max_grad_norm=0.05,
                                    optim_args=f"head_grad={head_grad},clip_pass={clip_pass}"))
    _, lb, gb = _train(ref, _args(tmp_path / "r", "adamw_torch", max_grad_norm=0.05))
    assert max(gb) > 0.05  # clipping was active
    assert la == pytest.approx(lb, rel=1e-5)
    assert ga == pytest.approx(gb, rel=1e-4)
    _assert_weights_close(model, ref)
    # replay walks the graph once per step, "backward" twice (7 linears per layer; the head is not a fused linear)
    walks = {"replay": 1, "backward": 2}[clip_pass]
    assert len(calls) == 4 * walks * 7 * model.config.num_hidden_layers
    assert all(p.grad is None for p in model.parameters())


def _linear_norm_path(monkeypatch, path: str) -> None:
    """Force how the replay's norm pass measures a linear layer: "tiles" (dW tiles, recomputed in the replay),
    "gram" (the token Grams; chosen on its own for few tokens against wide layers, the tiny model's are too narrow)
    or "keep" (the tiles kept for the replay; chosen on its own when they fit under the step's peak so far)."""
    from memgrad_hf.kernels import forge as K
    from memgrad_hf.optim import forge_clip

    monkeypatch.setattr(K, "gram_pays", lambda *a: path == "gram")
    monkeypatch.setattr(forge_clip, "headroom", lambda device: (1 << 40) if path == "keep" else 0)


@pytest.mark.parametrize("tied,path", [(False, "tiles"), (True, "gram"), (False, "keep")],
                         ids=["untied", "tied_gram", "untied_keep"])
def test_exact_clipping_replay_equals_adamw_torch_and_skips_non_finite_steps(tmp_path, monkeypatch, tied, path):
    # replay records the fused embedding (untied) or the tied weight's autograd gradient (tied) beside the linears;
    # a step whose norm is not finite is dropped whole, as by the second backward
    _linear_norm_path(monkeypatch, path)
    model = tiny_model("llama", tied=tied)
    ref = copy.deepcopy(model)
    _, la, ga = _train(model, _args(tmp_path / "f", "forge_adamw", max_grad_norm=0.05))
    _, lb, gb = _train(ref, _args(tmp_path / "r", "adamw_torch", max_grad_norm=0.05))
    assert max(gb) > 0.05 and la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)
    _assert_weights_close(model, ref)

    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3, max_grad_norm=1.0)
    assert opt._replays_clip()
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(1, 100, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    opt.backward(loss * float("nan"))
    opt.step()
    assert opt.skipped_steps == 1 and not math.isfinite(opt.last_grad_norm)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    opt.backward(model(input_ids=ids, labels=ids).loss)  # the next step applies
    opt.step()
    assert opt.skipped_steps == 1 and not all(torch.equal(p, b) for p, b in zip(model.parameters(), before,
                                                                                 strict=True))
    opt.detach()


@pytest.mark.parametrize("room", [1 << 30, 0, 3 * 512], ids=["ample", "none", "three_tiles"])
def test_the_replay_reads_the_memory_headroom_only_when_the_room_read_is_used_up(monkeypatch, room):
    """A headroom read is host time per layer (a GPU's step at batch 1 waits on it): one read per norm pass while it
    lasts, each kept layer charged twice its gradient's bytes, and after a read without room the next ones after 1,
    2, 4, ... more layers. What is kept never changes the update (the tests above force each path)."""
    from memgrad_hf.optim import forge_clip

    reads, kept = [], []
    monkeypatch.setattr(forge_clip, "headroom", lambda device: reads.append(device) or room)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(16)])  # 256 B per weight
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=1e-3)
    may_keep = opt._may_keep
    monkeypatch.setattr(opt, "_may_keep", lambda w: kept.append(may_keep(w)) or kept[-1])
    x = torch.randn(4, 8)
    opt.backward(model(x).square().mean())
    opt.step()
    if room == 1 << 30:
        assert (len(reads), sum(kept)) == (1, 16)
    elif room == 0:  # read at layers 1, 3, 6, 11 of 16
        assert (len(reads), sum(kept)) == (4, 0)
    else:  # three layers' tiles per read (each charged 512 B of the 1536)
        assert (len(reads), kept) == (6, [True, True, True] * 5 + [True])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(x).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_head_grad_auto_holds_only_small_heads_on_the_torch_path(monkeypatch):
    # "auto": hold the head gradient where its fp32 buffer is no larger than recomputing's own blocks (torch path)
    from memgrad_hf.optim import forge

    model = tiny_model("llama")
    memgrad_hf.patch_model(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3)
    small, big = model.lm_head.weight, torch.empty(40_000, 256)  # 13 KB and 41 MB of fp32 gradient
    assert opt.head_grad == "auto" and opt._hold_head_grad(small) and not opt._hold_head_grad(big)
    assert opt._head_weight_consumer(small).hold(4096)  # what the head patch calls, with its tokens
    mid = torch.empty(32768, 256)  # 32 MiB: held for 4096 tokens (recomputing's blocks: 36 MB), not for 64 (5 MB)
    assert opt._hold_head_grad(mid, tokens=4096) and not opt._hold_head_grad(mid, tokens=64)
    for mode, want in (("hold", True), ("recompute", False)):
        opt.head_grad = mode
        assert opt._hold_head_grad(small) is want and opt._hold_head_grad(big) is want
    opt.head_grad = "auto"
    monkeypatch.setattr(forge, "default_backend", lambda family, device=None: "triton")  # a GPU's Triton head
    assert not opt._hold_head_grad(small)
    with pytest.raises(ValueError, match="head_grad"):  # refused before it touches the model
        ForgeAdamW(model.parameters(), model=model, lr=1e-3, head_grad="sometimes")
    assert model._memgrad_forge_optimizer() is opt
    opt.detach()


def test_kernel_option_picks_the_gpu_weight_step(monkeypatch):
    # kernel=auto|fused|split chooses between the Triton kernels on a GPU; CPU runs the torch path either way
    forge_triton = pytest.importorskip("memgrad_hf.kernels.forge_triton")
    from memgrad_hf.kernels import forge as K
    from memgrad_hf.optim import forge

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kernel"):
        ForgeAdamW(model.parameters(), model=model, kernel="cublas")
    opt = ForgeAdamW(model.parameters(), model=model, kernel="split")
    w = model.model.layers[0].mlp.up_proj.weight
    assert opt._weight_step_impl(w) is K.linear_weight_step
    monkeypatch.setattr(forge, "default_backend", lambda family, device=None: "triton")  # as on a GPU
    assert opt._weight_step_impl(w) is forge_triton.linear_weight_step_split
    opt.kernel = "fused"
    assert opt._weight_step_impl(w) is forge_triton.linear_weight_step
    opt.kernel = "auto"  # the default: by the weight's size
    assert opt._weight_step_impl(w) is forge_triton.linear_weight_step
    monkeypatch.setattr(forge, "_SPLIT_MIN_NUMEL", w.numel())
    assert opt._weight_step_impl(w) is forge_triton.linear_weight_step_split
    opt.detach()


@pytest.mark.parametrize("max_grad_norm,head,clip_pass", [
    (0.0, False, "auto"), (0.05, False, "replay"), (0.05, False, "replay_keep"), (0.05, False, "backward"),
    (0.05, "recompute", "replay"), (0.05, "recompute", "replay_keep"), (0.05, "hold", "replay"),
    (0.05, "hold", "backward")],
    ids=["no_clip", "exact_clip", "exact_clip_keep", "exact_clip_backward", "exact_clip_chunked_head",
         "exact_clip_chunked_head_keep", "exact_clip_chunked_head_hold", "exact_clip_chunked_head_hold_backward"])
def test_forge_gradient_accumulation_equals_adamw_torch(tmp_path, monkeypatch, max_grad_norm, head, clip_pass):
    # with clipping, the norm pass runs on the last micro-batch over the accumulated gradients (fused weights hold
    # theirs in .grad meanwhile: counted once, kept for the update pass or the replay)
    keep = clip_pass.endswith("_keep")
    _linear_norm_path(monkeypatch, "keep" if keep else "tiles")
    clip_pass = clip_pass.removesuffix("_keep")
    from memgrad_hf.kernels import head as KH

    walks = []  # the recomputing head's vocabulary walks: one per backward, plus one per replay unless kept
    real_walk = KH.head_backward_vocab_blocks
    monkeypatch.setattr(KH, "head_backward_vocab_blocks", lambda *a, **k: (walks.append(1), real_walk(*a, **k))[1])
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    if head:
        memgrad_hf.patch_model(model)
    kw = dict(gradient_accumulation_steps=2, max_steps=3, max_grad_norm=max_grad_norm)
    opts = f"clip_pass={clip_pass}" + (f",head_grad={head}" if head else "")
    _, la, ga = _train(model, _args(tmp_path / "f", "forge_adamw", optim_args=opts, **kw))
    _, lb, gb = _train(ref, _args(tmp_path / "r", "adamw_torch", **kw))
    assert la == pytest.approx(lb, rel=1e-5)
    if max_grad_norm:
        assert max(gb) > max_grad_norm and ga == pytest.approx(gb, rel=1e-4)
    _assert_weights_close(model, ref)
    if head == "recompute":  # 3 steps of 2 micro-batches; the last micro-batch's backward records the replay
        assert len(walks) == 3 * 2 + (0 if keep else 3)


class _RefLion(torch.optim.Optimizer):
    """Reference Lion (Chen et al. 2023), written independently of memgrad's kernels."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                m = st.setdefault("m", torch.zeros_like(p))
                p.mul_(1 - g["lr"] * g["weight_decay"])
                c = g["betas"][0] * m + (1 - g["betas"][0]) * p.grad
                p.add_(torch.sign(c), alpha=-g["lr"])
                m.mul_(g["betas"][1]).add_(p.grad, alpha=1 - g["betas"][1])


def test_forge_lion_equals_reference_lion(tmp_path):
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    args = _args(tmp_path / "f", "forge_lion", learning_rate=1e-3, adam_beta2=0.99)
    _, la, _ = _train(model, args)
    args_r = _args(tmp_path / "r", "adamw_torch", learning_rate=1e-3, adam_beta2=0.99)
    t = Trainer(model=ref, args=args_r, train_dataset=_data())
    decay = set(t.get_decay_parameter_names(ref))
    groups = [
        {"params": [p for n, p in ref.named_parameters() if n in decay], "weight_decay": 0.1},
        {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    t.optimizer = _RefLion(groups, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    t.train()
    lb = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert la == pytest.approx(lb, rel=1e-5)
    _assert_weights_close(model, ref, rtol=1e-5)


@pytest.mark.parametrize("extra", [{}, dict(gradient_accumulation_steps=2, max_grad_norm=0.05,
                                             optim_args="state_dtype=bf16,stochastic_rounding=true"),
                                   dict(optim_args="state_dtype=8bit")],
                         ids=["fp32", "accumulation_clipping_bf16_state", "8bit_state"])
def test_checkpoint_resume_is_bit_identical(tmp_path, monkeypatch, extra):
    import memgrad_hf.optim.forge as F

    monkeypatch.setattr(F, "_MIN_8BIT_NUMEL", 0)  # (8-bit state: the tiny model's matrices are below the default)
    torch.manual_seed(0)
    full = tiny_model("llama")
    part = copy.deepcopy(full)
    _train(full, _args(tmp_path / "full", "forge_adamw", max_steps=4, **extra))
    args = _args(tmp_path / "part", "forge_adamw", max_steps=4, save_strategy="steps", save_steps=2, **extra)
    t = Trainer(model=part, args=args, train_dataset=_data())
    t.train()
    resumed_model = tiny_model("llama", seed=123)  # different init: everything must come from the checkpoint
    t2 = Trainer(model=resumed_model, args=args, train_dataset=_data())
    t2.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"))
    if "8bit" in extra.get("optim_args", ""):  # the matrices' state came back as codes, not converted
        assert any(st["exp_avg"].dtype == torch.uint8 for st in t2.optimizer.state.values())
    for (n, p), q in zip(resumed_model.named_parameters(), full.parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("optim_args", ["", "state_dtype=bf16"], ids=["fp32_state", "bf16_state"])
def test_checkpoint_resume_is_bit_identical_when_the_memory_headroom_differs(tmp_path, monkeypatch, optim_args):
    # exact clipping keeps a layer's gradient tiles for its update where memory allows, else forms them again; a
    # resumed process sees another headroom, so both ways must give the same norm and update, bit for bit. (bf16
    # state: a kept tile was updated in flat chunks, a formed one in rows, and the compiled CPU update takes only
    # the rows: the last bit differed, and the full suite's resume test failed when its headroom happened to differ)
    from memgrad_hf.optim import forge_clip

    torch.manual_seed(0)
    full = tiny_model("llama")
    part = copy.deepcopy(full)
    monkeypatch.setattr(forge_clip, "headroom", lambda device: 1 << 40)  # every tile kept
    _, _, grad_norms = _train(full, _args(tmp_path / "full", "forge_adamw", max_steps=4, max_grad_norm=0.05,
                                          optim_args=optim_args))
    assert min(grad_norms) > 0.05  # clipping was active at every step
    monkeypatch.setattr(forge_clip, "headroom", lambda device: 0)  # every tile formed again
    args = _args(tmp_path / "part", "forge_adamw", max_steps=4, max_grad_norm=0.05, save_strategy="steps", save_steps=2,
                 optim_args=optim_args)
    Trainer(model=part, args=args, train_dataset=_data()).train()
    resumed_model = tiny_model("llama", seed=123)
    Trainer(model=resumed_model, args=args, train_dataset=_data()).train(
        resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"))
    for (n, p), q in zip(resumed_model.named_parameters(), full.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_load_state_dict_into_the_same_optimizer_rewinds_exactly():
    """An optimizer that has already stepped loads an earlier state (its own, saved) and the model's weights from
    then: the next step repeats the original one bit for bit. The optimizer resolves each linear weight's update
    once (its state tensors among it), so this fails if a load left it updating the replaced tensors."""
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, weight_decay=0.1)
    ids = torch.randint(1, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after = [p.detach().clone() for p in model.parameters()]
    model(input_ids=ids, labels=ids).loss.backward()  # one step further, then back
    opt.step()
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for (n, p), q in zip(model.named_parameters(), after, strict=True):
        assert torch.equal(p, q), n
    assert all(int(st["step"]) == 2 for st in opt.state.values())


def test_second_trainer_on_same_model_takes_over(tmp_path):
    model = tiny_model("llama")
    _train(model, _args(tmp_path / "a", "forge_adamw", max_steps=2))
    ref = copy.deepcopy(model)
    for m in ref.modules():  # a plain copy for the reference: no forge swaps
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_memgrad_forge", None)
    ref.__dict__.pop("_memgrad_forge_optimizer", None)
    _, la, _ = _train(model, _args(tmp_path / "b", "forge_adamw", max_steps=2))
    _, lb, _ = _train(ref, _args(tmp_path / "c", "adamw_torch", max_steps=2))
    assert la == pytest.approx(lb, rel=1e-5)  # the first optimizer's hooks no longer update anything
    _assert_weights_close(model, ref)


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_create_optimizer_before_train_leaves_the_model_plain_until_train(tmp_path, max_grad_norm):
    # trainer.create_optimizer() before train() (to inspect the groups): FORGE attaches when train() starts, so a
    # backward before that (a sanity check) fills .grad as stock's does, and training then equals stock's
    runs = {}
    for optim in ("forge_adamw", "adamw_torch"):
        model = tiny_model("llama")
        trainer = Trainer(model=model, args=_args(tmp_path / optim, optim, max_grad_norm=max_grad_norm),
                          train_dataset=_data())
        trainer.create_optimizer()
        before = copy.deepcopy(model.state_dict())
        batch = {"input_ids": torch.tensor([_data()[0]["input_ids"]]), "labels": torch.tensor([_data()[0]["labels"]])}
        model(**batch).loss.backward()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), optim
        assert all(p.grad is not None for p in model.parameters()), optim
        trainer.train()
        runs[optim] = model
    _assert_weights_close(runs["forge_adamw"], runs["adamw_torch"])


def test_an_optimizer_given_to_the_trainer_with_optim_forge_is_warned_about(tmp_path, caplog):
    # the Trainer uses optimizers=(opt, ...) / optimizer_cls_and_kwargs and ignores args.optim: forge_adamw with a
    # LoRA+ AdamW silently trained without FORGE
    model = tiny_model("llama")
    given = [dict(optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-3), None)),
             dict(optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-3})),
             dict(optimizer_cls_and_kwargs=(ForgeAdamW, {"lr": 1e-3, "forge_model": model})), {}]
    warned = []
    for i, kw in enumerate(given):
        caplog.clear()
        t = Trainer(model=model, args=_args(tmp_path / str(i), "forge_adamw", max_steps=1), train_dataset=_data(),
                    **kw)
        with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
            t.train()
        warned.append(any("optim=forge_adamw is ignored" in r.getMessage() for r in caplog.records))
        t.optimizer = None  # (a later Trainer takes the model over)
    assert warned == [True, True, False, False]


def test_cli_parses_forge_names_and_their_pickles_load_without_importing_memgrad(tmp_path):
    import pickle
    import subprocess
    import sys

    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", "forge_lion", "--optim_args", "state_dtype=bf16", "--use_cpu"])
    assert args.optim == "forge_lion" and args.optim_args == "state_dtype=bf16"
    # a checkpoint's training_args.bin, loaded by a process that never imported memgrad_hf (inspecting a run)
    (tmp_path / "training_args.bin").write_bytes(pickle.dumps(args))
    code = "import pickle, sys; print(pickle.load(open(sys.argv[1], 'rb')).optim.value)"
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "training_args.bin")], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "forge_lion", res.stderr[-2000:]


def test_fp16_and_bad_optim_args_are_refused(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="fp16"):
        t = Trainer(model=model, args=_args(tmp_path, "forge_adamw"), train_dataset=_data())
        t.args.fp16 = True  # (fp16 cannot be enabled on CPU at construction; the handler checks it)
        t.create_optimizer()
    with pytest.raises(ValueError, match="optim_args"):
        t = Trainer(model=model, args=_args(tmp_path, "forge_adamw", optim_args="foo=1"), train_dataset=_data())
        t.create_optimizer()
    for optim, key, flag in (("forge_adamw", "weight_decay", "--weight_decay"),
                             ("forge_lion", "beta2", "--adam_beta1 / --adam_beta2"),
                             ("forge_adamw", "eps", "--adam_epsilon")):
        with pytest.raises(ValueError, match=f"optim_args {key}: .* set {flag}"):  # where it goes, not only "unknown"
            Trainer(model=model, args=_args(tmp_path, optim, optim_args=f"{key}=0.5"),
                    train_dataset=_data()).create_optimizer()
    # Lion has no epsilon: it was sent to --adam_epsilon, which Lion ignores; a bad flag names its key
    for optim_args, want in (("eps=1e-6", "forge_lion has no epsilon"),
                             ("stochastic_rounding=maybe", "optim_args stochastic_rounding must be true or false"),
                             # a value outside its choices names optim_args too, as a bad key does
                             ("clip=exakt", r"optim_args clip must be one of \('exact', 'previous'\); got 'exakt'"),
                             ("state_dtype=bf32", "optim_args state_dtype must be one of")):
        with pytest.raises(ValueError, match=want):
            Trainer(model=model, args=_args(tmp_path, "forge_lion", optim_args=optim_args),
                    train_dataset=_data()).create_optimizer()
    # keys as values are read case-insensitively (an upper-case key is no typo)
    opt = Trainer(model=model, args=_args(tmp_path, "forge_adamw", optim_args=" CLIP = Previous ,State_Dtype=BF16"),
                  train_dataset=_data()).create_optimizer()
    assert (opt.clip, opt.state_dtype) == ("previous", torch.bfloat16)
    with pytest.raises(TypeError, match="hyperparameters are model, lr, momentum"):  # a misspelt momentum
        ForgeSGD(model.parameters(), model=model, momentm=0.9)


def _steps_side_by_side(model, opt, ref, ref_opt, ids, steps: int) -> None:
    """``steps`` plain-loop steps of a FORGE optimizer and a torch.optim one on a copy of the model."""
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()


def test_standalone_loop_and_non_finite_gradients_skip(tmp_path):
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    ids = torch.randint(1, 100, (2, 8))
    _steps_side_by_side(model, opt, ref, ref_opt, ids, 2)
    _assert_weights_close(model, ref)
    before = [p.detach().clone() for p in model.parameters()]
    (model(input_ids=ids, labels=ids).loss * float("nan")).backward()
    opt.step()
    assert opt.skipped_steps == 1
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    assert all(torch.isfinite(v).all() for st in opt.state.values() for v in st.values())


def test_constructor_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs the model"):
        ForgeAdamW(model.parameters())
    with pytest.raises(ValueError, match="clip"):
        ForgeAdamW(model.parameters(), model=model, clip="sometimes")
    with pytest.raises(ValueError, match="clip_pass must be one of"):
        ForgeAdamW(model.parameters(), model=model, clip_pass="twice")
    with pytest.raises(ValueError, match="betas"):
        ForgeAdamW(model.parameters(), model=model, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="tile_bytes"):
        ForgeAdamW(model.parameters(), model=model, tile_bytes=0)
    with pytest.raises(TypeError, match="stochastic_rounding must be True or False"):  # bool("false") is True
        ForgeAdamW(model.parameters(), model=model, stochastic_rounding="false")
    with pytest.raises(TypeError, match="nesterov must be True or False"):
        ForgeSGD(model.parameters(), model=model, momentum=0.9, nesterov="false")
    opt = ForgeAdamW(model.parameters(), model=model)  # automatic tiles: 4 MiB on CPU, 64 MiB on a GPU
    assert opt._tile_bytes(model.lm_head.weight) == 4 << 20
    # on a GPU, kernel="auto" (default): cuBLAS tiles (split) for weights of 4096 x 4096 elements and more, whose
    # tiles cost host time each and so are larger; only the device and the size are read
    small, big = (types.SimpleNamespace(device=torch.device("cuda"), numel=lambda n=n: n) for n in (2048**2, 4096**2))
    assert opt.kernel == "auto" and opt._linear_kernel(small) == "fused" and opt._linear_kernel(big) == "split"
    assert opt._tile_bytes(small, linear=True) == opt._tile_bytes(big) == 64 << 20
    assert opt._tile_bytes(big, linear=True) == 256 << 20
    assert opt._tile_bytes(model.lm_head.weight, linear=True) == 4 << 20  # CPU
    opt.kernel = "fused"
    assert opt._linear_kernel(big) == "fused" and opt._tile_bytes(big, linear=True) == 64 << 20
    opt.kernel = "split"
    assert opt._linear_kernel(small) == "split" and opt._tile_bytes(small, linear=True) == 256 << 20
    opt.detach()
    assert ForgeAdamW(model.parameters(), model=model, tile_bytes=1 << 16)._tile_bytes(model.lm_head.weight) == 1 << 16


@pytest.mark.parametrize("reentrant,clip_pass", [(False, "auto"), (True, "auto"), (False, "replay"), (True, "replay")],
                         ids=["non_reentrant", "reentrant", "non_reentrant_replay", "reentrant_replay"])
def test_forge_with_gradient_checkpointing_and_exact_clipping(tmp_path, monkeypatch, reentrant, clip_pass):
    # recomputed forwards run the fused linears again; "auto" takes the second backward here (the norm pass and
    # the update pass each recompute), "replay" records from the one recomputing backward
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    gc = dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": reentrant},
              max_grad_norm=0.05)
    calls = _count_linear_backwards(monkeypatch)
    _, la, ga = _train(model, _args(tmp_path / "f", "forge_adamw", optim_args=f"clip_pass={clip_pass}", **gc))
    linears = 7 * model.config.num_hidden_layers + 1  # + lm_head (no chunked head here)
    assert len(calls) == 4 * (1 if clip_pass == "replay" else 2) * linears
    _, lb, gb = _train(ref, _args(tmp_path / "r", "adamw_torch", **gc))
    assert max(gb) > 0.05  # clipping was active
    assert la == pytest.approx(lb, rel=1e-5)
    assert ga == pytest.approx(gb, rel=1e-4)
    _assert_weights_close(model, ref)


def _shared_norm_model():
    """Tiny llama whose two layers share one norm weight, and a penalty on another norm in the loss: under reentrant
    checkpointing each gradient arrives in parts, one per nested segment backward (and one from the loss)."""
    model = tiny_model("llama")
    model.model.layers[1].post_attention_layernorm.weight = model.model.layers[0].post_attention_layernorm.weight
    return model


class _PenaltyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss + 0.1 * model.model.layers[0].input_layernorm.weight.pow(2).sum()


@pytest.mark.parametrize("max_grad_norm,clip_pass", [(0.0, "auto"), (0.05, "auto"), (0.05, "replay")],
                         ids=["no_clip", "clip_backward", "clip_replay"])
def test_gradients_in_parts_under_reentrant_checkpointing_are_applied_once(tmp_path, max_grad_norm, clip_pass):
    # Each segment's nested backward fired the hook with its part of the gradient: one AdamW update per part
    # (0.43 relative off adamw_torch after 3 steps; the penalized norm 1.2e-2 off); they now wait for the end
    models = [_shared_norm_model(), _shared_norm_model()]
    kw = dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True},
              max_grad_norm=max_grad_norm)
    gn = []
    for model, optim, extra in ((models[0], "forge_adamw", {"optim_args": f"clip_pass={clip_pass}"}),
                                (models[1], "adamw_torch", {})):
        t = _PenaltyTrainer(model=model, args=_args(tmp_path / optim, optim, **kw, **extra), train_dataset=_data())
        t.train()
        gn.append([h["grad_norm"] for h in t.state.log_history if "loss" in h])
    assert gn[0] == pytest.approx(gn[1], rel=1e-5)
    _assert_weights_close(*models)


@pytest.mark.parametrize("penalty,ckpt", [(False, {"use_reentrant": True}), (True, {"use_reentrant": True}),
                                           (True, {}), (True, {"use_reentrant": None})],
                         ids=["shared", "penalty", "penalty_torch_default", "penalty_none"])
def test_gradients_in_parts_under_reentrant_checkpointing_in_a_hand_written_loop(penalty, ckpt):
    # (ckpt {} or None: torch's checkpoint takes use_reentrant=True: a penalty's two parts were two updates)
    model = _shared_norm_model()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
        m.train()
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = m(input_ids=ids, labels=ids).loss
            if penalty:
                loss = loss + 0.1 * m.model.layers[0].input_layernorm.weight.pow(2).sum()
            opt.backward(loss) if o is opt else loss.backward()
            o.step()
            o.zero_grad()
    opt.detach()
    _assert_weights_close(model, ref)


@pytest.mark.parametrize("family", ["dory", "gemma3n_text"])
def test_fused_layers_used_twice_under_reentrant_checkpointing_are_updated_once(tmp_path, family):
    # dory loops its middle layers (one layer, several checkpointed segments); gemma3n's AltUp router runs twice in
    # one layer (one segment). A segment's first forward runs without autograd, so FORGE saw no second use, and each
    # part of the gradient was one AdamW update in its segment's backward (dory 3.2e-3, gemma3n 1.2e-4 off after 2
    # steps in `bench compat --forge --checkpointing`)
    from benchmarks.compat import _tiny

    model = _tiny(family)
    ref = copy.deepcopy(model)
    gc = dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True},
              max_grad_norm=0.05, max_steps=3)
    _, la, ga = _train(model, _args(tmp_path / "f", "forge_adamw", **gc))
    _, lb, gb = _train(ref, _args(tmp_path / "r", "adamw_torch", **gc))
    assert min(gb) > 0.05  # clipping was active
    assert la == pytest.approx(lb, rel=1e-5)
    assert ga == pytest.approx(gb, rel=1e-5)
    _assert_weights_close(model, ref)


def test_reentrant_checkpointing_with_accumulation_marks_no_weight_as_used_twice(tmp_path, caplog):
    # each micro-batch's forward counts its segment uses afresh: a layer is not "used twice" across micro-batches
    # (it would take the per-tensor path, its gradient in full, and a warning)
    model = tiny_model("llama")
    gc = dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True},
              gradient_accumulation_steps=2, max_grad_norm=0.05)
    with caplog.at_level("WARNING", logger="memgrad_hf.forge"):
        _train(model, _args(tmp_path, "forge_adamw", **gc))
    assert "used more than once" not in caplog.text


@pytest.mark.parametrize("max_grad_norm,clip_pass", [(0.05, "replay"), (0.05, "backward"), (0.0, "auto")])
def test_parameters_unfrozen_outside_the_optimizer_count_in_the_clipping_norm(tmp_path, max_grad_norm, clip_pass):
    # The Trainer clips over model.parameters(): a parameter made trainable after the optimizer was built is never
    # updated, but its gradient enters the norm (FORGE measured only its groups: grad_norm and clipping differed;
    # without clipping the logged grad_norm left it out)
    from transformers import TrainerCallback

    class Unfreeze(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            if state.global_step == 1:
                model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)

    models = [tiny_model("llama"), tiny_model("llama")]
    gn = []
    for model, optim in zip(models, ("forge_adamw", "adamw_torch"), strict=True):
        model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
        args = _args(tmp_path / optim, optim, max_grad_norm=max_grad_norm,
                     **({"optim_args": f"clip_pass={clip_pass}"} if optim == "forge_adamw" else {}))
        t = Trainer(model=model, args=args, train_dataset=_data(), callbacks=[Unfreeze()])
        t.train()
        gn.append([h["grad_norm"] for h in t.state.log_history if "loss" in h])
    assert gn[0] == pytest.approx(gn[1], rel=1e-5) and gn[1][1] > gn[1][0] / 10
    _assert_weights_close(*models)


def _forge_vs_adamw(tmp_path, model, **kw):
    """Train ``model`` with forge_adamw and a copy with adamw_torch (same arguments); weights must end close.
    Returns the logged losses and grad norms, ``(forge, torch)``."""
    ref = copy.deepcopy(model)
    _, la, ga = _train(model, _args(tmp_path / "f", "forge_adamw", **kw))
    _, lb, gb = _train(ref, _args(tmp_path / "r", "adamw_torch", **kw))
    _assert_weights_close(model, ref)
    return (la, ga), (lb, gb)


@pytest.mark.parametrize("max_grad_norm,gram", [(0.0, False), (0.5, False), (0.5, True)])
def test_forge_under_bf16_autocast_equals_adamw_torch(tmp_path, monkeypatch, max_grad_norm, gram):
    # Trainer(bf16=True) on fp32 weights: the fused linears compute in bf16 like autocast's nn.Linear and hand the
    # optimizer the fp32-cast bf16 weight gradient, as autograd does; clipping scales that gradient, as
    # clip_grad_norm_ does (scaling dY before the GEMM rounds otherwise: Adam turns that into 1e-1 weight errors).
    # gram: every layer where the norm through the [tokens x tokens] Grams would pay (few tokens, wide layers): they
    # measured the unrounded product (grad_norm 1.4e-4 off, weights 2e-3 apart in a LoRA + lm_head run)
    if gram:
        monkeypatch.setattr("memgrad_hf.kernels.forge.gram_pays", lambda *a: True)
    (la, ga), (lb, gb) = _forge_vs_adamw(tmp_path, tiny_model("llama"), bf16=True, max_grad_norm=max_grad_norm,
                                         max_steps=6)
    assert la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-5)
    assert max(gb) > max_grad_norm


def test_forge_with_trainer_compile_checkpointing_accumulation_and_clipping_equals_adamw_torch(tmp_path,
                                                                                             fresh_compile):
    """``torch_compile`` (aot_eager: inductor's graph capture without its code generation), activation
    checkpointing, accumulation and the default exact clipping together: the norm-only backward runs through the
    compiled graph before the update backward (torch's donated buffers refused that until FORGE turned them off)."""
    (la, ga), (lb, gb) = _forge_vs_adamw(
        tmp_path, tiny_model("llama", tied=True), torch_compile=True, torch_compile_backend="aot_eager",
        activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False},
        gradient_accumulation_steps=2, max_grad_norm=0.05)
    assert max(gb) > 0.05 and la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)


@pytest.mark.parametrize("head_grad,max_grad_norm", [("hold", 0.0), ("recompute", 0.0), ("hold", 0.5),
                                                     ("recompute", 0.5)])
def test_forge_with_the_chunked_head_under_bf16_autocast_equals_adamw_torch(tmp_path, head_grad, max_grad_norm):
    # the bf16 head's gradient is summed in vocabulary blocks as its plain backward does, whatever head_grad says;
    # each block is cast to the fp32 weight's dtype before clipping scales it, as autograd casts the gradient before
    # clip_grad_norm_ scales it (scaled in bf16 it was one rounding off: 1.7e-3 of an update)
    model = memgrad_hf.patch_model(tiny_model("llama"))
    ref = copy.deepcopy(model)
    _, la, ga = _train(model, _args(tmp_path / "f", "forge_adamw", bf16=True, optim_args=f"head_grad={head_grad}",
                                    max_grad_norm=max_grad_norm))
    _, lb, gb = _train(ref, _args(tmp_path / "r", "adamw_torch", bf16=True, max_grad_norm=max_grad_norm))
    assert la == pytest.approx(lb, rel=1e-6) and ga == pytest.approx(gb, rel=1e-6)
    assert max(gb) > max_grad_norm
    _assert_weights_close(model, ref)


def test_forge_trains_titans_injected_model_like_adamw_torch(tmp_path):
    from memgrad_hf.titans import TitansConfig

    model = tiny_model("llama")
    memgrad_hf.patch_model(model, titans=TitansConfig(layers=[0]))
    (la, ga), (lb, gb) = _forge_vs_adamw(tmp_path, model)
    assert la == pytest.approx(lb, rel=1e-5)
    assert ga == pytest.approx(gb, rel=1e-4)


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_forge_distilling_titans_fans_under_reentrant_checkpointing_equals_adamw_torch(tmp_path, max_grad_norm):
    # A FAN runs only with autograd on, so under reentrant checkpointing only in the backward's recompute, once per
    # chunk: its layers' uses there went unseen and each chunk applied an update of its own (FAN weights 6e-2 apart
    # after 3 steps, the memory's gamma 33% after the switch)
    from memgrad_hf.callbacks import FANDistillationCallback
    from memgrad_hf.titans import TitansConfig

    models = []
    for optim in ("forge_adamw", "adamw_torch"):
        model = memgrad_hf.patch_model(tiny_model("llama"), head=False,
                                       titans=TitansConfig(layers=[1], heads=2, chunk_size=4, fan=True))
        args = _args(tmp_path / optim, optim, max_grad_norm=max_grad_norm, max_steps=3, activation_checkpointing=True,
                     activation_checkpointing_kwargs={"use_reentrant": True})
        Trainer(model=model, args=args, train_dataset=_data(),
                callbacks=[FANDistillationCallback(distill_steps=2)]).train()  # distils, then switches at step 2
        models.append(model)
    _assert_weights_close(*models)


def test_forge_with_a_traced_head_module_equals_adamw_torch(tmp_path):
    # a head module with its own forward (a learned per-word logit scale) under patch_model: its effective weight
    # goes through autograd, so its weight and scale are updated from their complete gradients by the hooks
    from tests.tiny_models import with_word_scaled_head

    model = memgrad_hf.patch_model(with_word_scaled_head(tiny_model("llama")), chunk_size=4)
    (la, ga), (lb, gb) = _forge_vs_adamw(tmp_path, model, max_grad_norm=1.0)
    assert la == pytest.approx(lb, rel=1e-5)
    assert ga == pytest.approx(gb, rel=1e-4)


@pytest.mark.slow  # ~30 s of compilation on a 2-core CPU
def test_forge_with_trainer_torch_compile_equals_adamw_torch(tmp_path):
    (la, _), (lb, _) = _forge_vs_adamw(tmp_path, tiny_model("llama"), torch_compile=True)
    assert la == pytest.approx(lb, rel=1e-5)


@pytest.mark.parametrize("patched", [False, True], ids=["adamw", "sgd_chunked_head"])
def test_clip_previous_scales_by_the_previous_steps_norm(patched):
    """clip='previous': step t is clipped with step t-1's gradient norm (step 1 unclipped), and the norm logged at
    step t is step t's own, unclipped. Reference: torch.optim on explicitly scaled gradients; a small max_grad_norm
    makes every step after the first clip. With the chunked head its weight gradient takes the block path, whose
    norm is corrected for the clipping; SGD there, which (unlike Adam) shows any error in the gradient's scale, and
    is not thrown off where a gradient element is ~eps (Adam turns the head's fp32 summation-order differences of
    ~1e-9 there into 2e-3 of a weight)."""
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    kw = dict(max_grad_norm=0.05, clip="previous")
    if patched:
        memgrad_hf.patch_model(model, chunk_size=5)
        memgrad_hf.patch_model(ref, chunk_size=5)
        opt = ForgeSGD(model.parameters(), model=model, lr=0.5, momentum=0.9, head_grad="recompute", **kw)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    else:
        opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, weight_decay=0.1, **kw)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(1, 100, (2, 8))
    prev = None
    for step in range(4):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        ref(input_ids=ids, labels=ids).loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in ref.parameters()])).item()
        coef = 1.0 if prev is None else min(1.0, 0.05 / (prev + 1e-6))
        if step > 0:
            assert coef < 0.5  # the test clips
        for p in ref.parameters():
            p.grad.mul_(coef)
        ref_opt.step()
        ref_opt.zero_grad()
        assert opt.last_grad_norm == pytest.approx(norm, rel=1e-5), step
        prev = norm
    _assert_weights_close(model, ref)


def test_a_callback_acting_after_backward_is_warned_about(tmp_path, caplog):
    # an lr set in on_pre_optimizer_step applies to torch's step, but FORGE had already updated in backward: it was
    # ignored (then overwritten by the scheduler) without a word, as were gradients read or edited there
    from transformers import TrainerCallback

    class LateLR(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
            for g in optimizer.param_groups:
                g["lr"] = 1e-3 * (state.global_step + 1)

    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        t = Trainer(model=tiny_model("llama"), args=_args(tmp_path, "forge_adamw", max_steps=2),
                    train_dataset=_data(), callbacks=[LateLR()])
        t.train()
    assert "LateLR run on_pre_optimizer_step" in caplog.text  # at train(), before any step
    assert "lr changed between backward and step()" in caplog.text  # at the first step() it happened
    caplog.clear()
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    class MyJIT(JITCheckpointCallback):  # a library's hook, inherited unchanged: nothing to say
        pass

    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):  # the scheduler: no warning either
        Trainer(model=tiny_model("llama"), args=_args(tmp_path, "forge_adamw", max_steps=2), train_dataset=_data(),
                callbacks=[MyJIT()]).train()
    assert "between backward and step()" not in caplog.text and "on_pre_optimizer_step" not in caplog.text


def test_an_lr_set_after_backward_in_a_loop_is_warned_about(caplog):
    model = tiny_model("llama")
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-3)
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        for lr in (1e-3, 2e-3):  # set before the forward: applies to the step, nothing to say
            opt.param_groups[0]["lr"] = lr
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        assert "between backward and step()" not in caplog.text
        model(input_ids=ids, labels=ids).loss.backward()
        opt.param_groups[0]["lr"] = 5e-3  # after: torch's step would use it, FORGE already updated
        opt.step()
    assert "lr changed between backward and step()" in caplog.text
    opt.detach()
    caplog.clear()
    opt = ForgeAdamW(model.parameters(), model=model, lr=torch.tensor(1e-3))  # changed in place, as schedulers do
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.param_groups[0]["lr"].fill_(5e-4)
        opt.step()
    assert "lr changed between backward and step()" in caplog.text
    opt.detach()


def test_the_default_exact_clipping_is_not_warned_about_and_clip_previous_is(tmp_path, caplog):
    # every default forge_* run (max_grad_norm=1.0, exact: stock's result) used to log a WARNING
    model = torch.nn.Linear(4, 4)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        for optim_args in (None, "clip=previous"):
            args = TrainingArguments(output_dir=str(tmp_path), optim="forge_adamw", optim_args=optim_args,
                                     use_cpu=True, report_to="none")
            Trainer.get_optimizer_cls_and_kwargs(args, model)
            assert ("applied approximately" in caplog.text) == (optim_args is not None), caplog.text
    assert "applied exactly" not in caplog.text


class _LossWithClassifier(nn.Module):
    """A loss module holding the model and a trainable classifier of its own (sentence-transformers' SoftmaxLoss)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        torch.manual_seed(1)
        self.classifier = nn.Linear(model.config.vocab_size, 3)

    def forward(self, inputs):
        logits = self.model(input_ids=inputs["input_ids"]).logits[:, -1]
        target = inputs["input_ids"][:, 0] % 3
        return self.model(**inputs).loss + nn.functional.cross_entropy(self.classifier(logits), target)


class _LossModuleTrainer(Trainer):
    """The optimizer trains the loss module's parameters too, built for the loss module, as sentence-transformers'
    trainer does; the Trainer's clipping covers ``self.model`` only."""

    def __init__(self, *args, loss_module, **kwargs):
        self.loss_module = loss_module
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self.loss_module(inputs)

    def training_step(self, *args, **kwargs):
        # the Trainer zeroes model.zero_grad() only: the classifier's .grad would add up over steps for torch.optim
        # (FORGE leaves none), which no user wants to compare against
        self.loss_module.classifier.zero_grad()
        return super().training_step(*args, **kwargs)

    def create_optimizer(self, model=None):
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.loss_module)
        self.optimizer = cls(self.loss_module.parameters(), **kwargs)
        return self.optimizer


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0], ids=["exact_clip", "no_clip"])
def test_parameters_trained_outside_the_trainers_model_are_left_unclipped_as_the_trainer_does(tmp_path,
                                                                                             max_grad_norm):
    # the Trainer clips clip_grad_norm_(model.parameters()): a loss module's classifier is neither in its norm nor
    # clipped; FORGE, built for the loss module, measured and clipped it too (grad_norm 4.48 against 4.20), and
    # without clipping logged it in the norm (which clip=previous then clips by)
    runs = {}
    for optim in ("adamw_torch", "forge_adamw"):
        model = tiny_model("llama")
        loss = _LossWithClassifier(model)
        t = _LossModuleTrainer(model=model, args=_args(tmp_path / optim, optim, max_grad_norm=max_grad_norm),
                               train_dataset=_data(), loss_module=loss)
        t.train()
        runs[optim] = (loss, [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h])
    (ref, ref_norms), (got, got_norms) = runs["adamw_torch"], runs["forge_adamw"]
    assert len(ref_norms) == 4 and got_norms == pytest.approx(ref_norms, rel=1e-5)
    assert all(n > 0.5 for n in ref_norms)  # every step clips (where it clips)
    _assert_weights_close(got, ref)
