"""FORGE under torch.compile: its layers are custom operators the compiled graph keeps (memgrad_hf.optim.forge_ops),
and training stays the same training. The ``aot_eager`` backend runs the same graph capture and autograd
partitioning as inductor without its code generation (seconds instead of ~30 s per model on this CPU); the Trainer
test with inductor is in the slow set (tests/optim/test_forge_trainer.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

from memgrad_hf import UnsupportedModelError
from memgrad_hf.optim import ForgeAdamW
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("fresh_compile")  # (tests/conftest.py)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(step))


def test_a_compiled_forge_model_has_the_graphs_of_the_stock_model():
    """Before the operators every fused layer broke the graph (a 2-layer tiny Llama: 20 graphs against 1)."""
    model = tiny_model("llama")
    stock = copy.deepcopy(model)
    ForgeAdamW(model.parameters(), model=model, lr=1e-3)
    ids = _ids(0)
    ours = dynamo.explain(lambda i: model(input_ids=i, labels=i).loss)(ids)
    dynamo.reset()
    theirs = dynamo.explain(lambda i: stock(input_ids=i, labels=i).loss)(ids)
    assert ours.graph_count == theirs.graph_count == 1, (ours.graph_count, ours.break_reasons)
    ops = {n.target for g in ours.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {torch.ops.memgrad.forge_linear, torch.ops.memgrad.forge_embedding} <= ops


def test_a_compiled_forge_model_with_the_chunked_head_breaks_only_where_the_head_does():
    """The chunked head is opaque to torch.compile (one break, with or without FORGE); FORGE's consumer of the head
    weight's gradient used to be traced up to a set of parameters and break there instead."""
    import memgrad_hf

    counts = []
    for forge in (False, True):
        dynamo.reset()
        model = memgrad_hf.patch_model(tiny_model("llama"))
        if forge:
            ForgeAdamW(model.parameters(), model=model, lr=1e-3)
        ex = dynamo.explain(lambda i, m=model: m(input_ids=i, labels=i).loss)(_ids(0))
        counts.append((ex.graph_count, ex.graph_break_count))
        stacks = [f.filename for r in ex.break_reasons for f in r.user_stack]
        assert not any(f.endswith("optim/forge.py") for f in stacks), stacks
    assert counts[0] == counts[1] == (2, 1), counts


def _train_side_by_side(model, steps=3, max_grad_norm=0.0, micro_batches=1):
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, weight_decay=0.1, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    norms = []
    for step in range(steps):
        for mb in range(micro_batches):
            ids = _ids(10 * step + mb)
            opt.sync = mb == micro_batches - 1
            compiled(input_ids=ids, labels=ids).loss.backward()
            ref(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm or float("inf"))
        norms.append((opt.last_grad_norm, float(norm)))
        ref_opt.step()
        ref_opt.zero_grad()
    return model, ref, norms


def _assert_same(model, ref, rtol=1e-5):
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is None, name  # the updates ran in backward
        err = ((p - q).norm() / q.norm()).item()
        assert err < rtol, (name, err)


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0], ids=["no_clip", "exact_clip"])
def test_compiled_forge_adamw_equals_adamw_torch(max_grad_norm):
    model, ref, norms = _train_side_by_side(tiny_model("llama"), max_grad_norm=max_grad_norm)
    _assert_same(model, ref)
    for ours, theirs in norms:
        assert ours == pytest.approx(theirs, rel=1e-5)


def test_compiled_forge_with_gradient_accumulation_and_tied_weights():
    model, ref, _ = _train_side_by_side(tiny_model("llama", tied=True), micro_batches=2)
    _assert_same(model, ref)


def test_compiled_forge_with_checkpointing_accumulation_and_exact_clipping():
    """Under gradient checkpointing exact clipping runs a norm-only backward, then the update backward, through one
    graph: torch's donated buffers (on by default) refused the second ("compiled with non-empty donated buffers");
    the optimizer turns them off for graphs compiled after it."""
    from torch._functorch import config

    config.donated_buffer = True
    model = tiny_model("llama", tied=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model, ref, norms = _train_side_by_side(model, max_grad_norm=0.05, micro_batches=2)
    assert not config.donated_buffer
    _assert_same(model, ref)
    for ours, theirs in norms:
        assert theirs > 0.05 and ours == pytest.approx(theirs, rel=1e-5)


def test_a_graph_compiled_with_donated_buffers_before_forge_gets_a_clear_error(monkeypatch):
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=1.0)

    backward = torch.autograd.backward

    def compiled_before(tensors, grad_tensors=None, retain_graph=None, *args, **kwargs):  # what torch raises there
        if retain_graph:  # for a graph compiled before the optimizer
            raise RuntimeError("This backward function was compiled with non-empty donated buffers which requires "
                               "create_graph=False and retain_graph=False.")
        return backward(tensors, grad_tensors, retain_graph, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", compiled_before)
    ids = _ids(0)
    with pytest.raises(RuntimeError, match="create the optimizer first"):
        opt.backward(model(input_ids=ids, labels=ids).loss)


def test_a_gradient_hook_on_a_compiled_fused_weight_is_refused():
    model = tiny_model("llama")
    model.model.layers[0].mlp.up_proj.weight.register_hook(lambda g: g * 0.5)
    ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ids = _ids(0)
    loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="gradient hook .* not supported under torch.compile"):
        loss.backward()


class _Twice(nn.Module):
    """A layer called twice in one forward: its weight's gradient has two parts, summed before one update."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 100, bias=False)

    def forward(self, input_ids, labels):
        h = self.mid(torch.tanh(self.mid(self.emb(input_ids))))
        loss = nn.functional.cross_entropy(self.out(h).flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss})()


def test_compiled_layer_called_twice_is_updated_once_from_its_whole_gradient():
    torch.manual_seed(0)
    model, ref, _ = _train_side_by_side(_Twice())
    _assert_same(model, ref)


def test_a_compiled_deep_copy_trains_plainly_and_leaves_the_original_alone():
    """An EMA / reference copy of a FORGE model runs the operators too, but no optimizer updates its weights: its
    backward puts the gradient in .grad (as nn.Linear's would) and updates nothing."""
    model = tiny_model("llama")
    ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    twin = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    ids = _ids(0)
    torch.compile(twin, backend="aot_eager")(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in before.items())
    ref = copy.deepcopy(twin)
    for p in ref.parameters():
        p.grad = None
    ref(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(twin.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_autograd_grad_through_a_compiled_forge_layer_is_refused():
    model = tiny_model("llama")
    ForgeAdamW(model.parameters(), model=model, lr=1e-2)
    ids = _ids(0)
    loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="autograd.grad .* compiled model is not supported"):
        torch.autograd.grad(loss, [model.model.layers[0].mlp.up_proj.weight])


def test_compiled_forge_on_lora_equals_adamw_torch():
    """LoRA on a frozen model: the first adapter's input needs no gradient and it has no bias, so its backward
    operator returns neither ``dX`` nor ``db`` (two absent results once came back as one tensor, which torch's
    operator checks refuse)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0, init_lora_weights="gaussian"))
    model, ref, _ = _train_side_by_side(model, max_grad_norm=1.0)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = ((p - q).norm() / q.norm()).item()
        assert err < 1e-5, (name, err)
        assert p.grad is None, name


def test_compiled_first_layer_without_input_gradient_or_bias():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=0.0)
    _square_loss_steps(torch.compile(model, backend="aot_eager"), opt, model, ref, steps=3)


def _square_loss_steps(run, opt, model, ref, steps):
    """``steps`` steps of a mean-square loss through ``run`` (``model``, compiled or not) with ``opt``, beside
    ``torch.optim.AdamW`` on the eager ``ref``; then the weights must be equal."""
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        run(x).square().mean().backward()
        ref(x).square().mean().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_the_compiled_graph_does_not_depend_on_the_optimizer():
    """A second optimizer on the same model (a second Trainer, another configuration) gets the same graph, which
    inductor's graph cache then serves again; the optimizer is found by the weight at run time. (The operators took
    an optimizer key once: each optimizer compiled a graph of its own.)"""
    model = tiny_model("llama")
    ids = _ids(0)
    codes, weights = [], []

    def backend(gm, inputs):
        codes.append(gm.code)
        return gm

    for opt_cls, kw in ((ForgeAdamW, dict(lr=1e-2)), (ForgeAdamW, dict(lr=1e-3, weight_decay=0.1))):
        dynamo.reset()
        opt = opt_cls(model.parameters(), model=model, **kw)
        before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
        torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
        weights.append(not torch.equal(before, model.model.layers[0].mlp.up_proj.weight))
        opt.step()
        opt.zero_grad()
        opt.detach()
    assert len(codes) == 2 and codes[0] == codes[1]
    assert weights == [True, True]  # each optimizer updated the weights in its backward


class _ClampsItsWeight(nn.Module):
    """Changes a layer's weight through .data in forward, as Gemma 3n's AltUp clamps ``prediction_coefs``."""

    def __init__(self):
        super().__init__()
        self.coefs = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        self.coefs.weight.data.clamp_(-0.2, 0.2)
        return self.out(torch.tanh(self.coefs(x)))


def test_a_weight_changed_through_data_in_a_compiled_forward_is_refused_not_lost():
    """Compiled, the clamped weight reaches the layer as a new tensor: FORGE cannot find the parameter, and its
    update would be lost silently (Gemma 3n under the compiled sweep). Eager FORGE trains it as torch does."""
    torch.manual_seed(0)
    model = _ClampsItsWeight()
    ref = copy.deepcopy(model)
    opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=0.0)
    with pytest.raises(UnsupportedModelError, match="changes the weight's .data in its forward"):
        torch.compile(model, backend="aot_eager")(torch.randn(4, 8)).square().mean().backward()
    dynamo.reset()
    opt.zero_grad()
    _square_loss_steps(model, opt, model, ref, steps=2)


def test_inductor_replay_records_copies_of_the_graphs_buffers(monkeypatch):
    """Exact clipping without room to keep the gradient tiles records each layer's ``dY`` and input for the replay;
    inside an inductor graph those are buffers the graph reuses once the operator returns, so the replay read other
    tensors' values (tiny Llama: weights 0.04 off the run that kept its tiles; two runs differed with the memory
    left). Both ways must now equal torch's AdamW with clipping."""
    from memgrad_hf.optim import forge_clip

    base = tiny_model("llama")
    ids = _ids(0)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        ref(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        ref_opt.step()
        ref_opt.zero_grad()
    runs = []
    for room in (0, 1 << 40):  # every tile formed again in the replay / every tile kept
        monkeypatch.setattr(forge_clip, "headroom", lambda device, room=room: room)
        model = copy.deepcopy(base)
        opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, max_grad_norm=0.01)
        compiled = torch.compile(model)  # inductor: it reuses buffers (aot_eager does not)
        for _ in range(2):
            opt.backward(compiled(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
        opt.detach()
        _assert_same(model, ref, rtol=1e-4)  # (inductor's fused kernels round differently from eager: ~1e-5)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
