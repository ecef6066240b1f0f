"""Behaviour of the patched head: HF loss options, eval/generate, save/unpatch, checkpointing, PEFT, errors."""

import copy
import logging

import pytest
import torch
from torch import nn

import memgrad_hf
from memgrad_hf import UnsupportedModelError
from tests.helpers import LargestTensor, enable_checkpointing
from tests.patches.test_models import _assert_same, _loss_and_grads
from tests.tiny_models import VOCAB, tiny_model


def _pair(family="llama", tied=False, **extra):
    model = tiny_model(family, tied=tied, **extra).train()
    return model, copy.deepcopy(model)


def _batch(b=2, t=9):
    ids = torch.randint(1, VOCAB, (b, t))
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


@pytest.mark.parametrize(
    "kw",
    [
        {"num_items_in_batch": torch.tensor(23)},  # what the Trainer passes under gradient accumulation
        {"num_items_in_batch": 5},
        {"ignore_index": 7},
    ],
    ids=["num_items_tensor", "num_items_int", "ignore_index"],
)
def test_hf_loss_kwargs_are_honoured(kw):
    model, ref = _pair()
    ids, labels = _batch()
    if "ignore_index" in kw:
        labels = ids.clone()
        labels[1, 2:5] = kw["ignore_index"]
    ref_out, ref_g = _loss_and_grads(ref, ids, labels, **kw)
    memgrad_hf.patch_model(model, chunk_size=3)
    out, g = _loss_and_grads(model, ids, labels, **kw)
    _assert_same(out, g, ref_out, ref_g)


def test_shift_labels_are_used_unshifted():
    model, ref = _pair()
    ids, _ = _batch()
    shift = torch.randint(0, VOCAB, ids.shape)
    shift[:, -2:] = -100
    ref_out, ref_g = _loss_and_grads(ref, ids, ids, shift_labels=shift)
    memgrad_hf.patch_model(model)
    out, g = _loss_and_grads(model, ids, ids, shift_labels=shift)
    _assert_same(out, g, ref_out, ref_g)


def test_logits_to_keep_with_labels_for_kept_positions():
    model, ref = _pair()
    ids, labels = _batch()
    ref_out, ref_g = _loss_and_grads(ref, ids, labels[:, -4:], logits_to_keep=4)
    memgrad_hf.patch_model(model)
    out, g = _loss_and_grads(model, ids, labels[:, -4:], logits_to_keep=4)
    _assert_same(out, g, ref_out, ref_g)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=labels, logits_to_keep=4)


def test_positional_labels_and_return_dict_false():
    model, ref = _pair()
    ids, labels = _batch()
    memgrad_hf.patch_model(model)
    torch.manual_seed(1)
    ref_loss = ref(ids, None, None, None, None, labels).loss
    out = model(ids, None, None, None, None, labels, return_dict=False)
    assert isinstance(out, tuple) and not any(isinstance(o, torch.Tensor) and o.dim() == 3 for o in out)
    assert torch.allclose(out[0], ref_loss, rtol=1e-6)


def test_eval_logits_and_loss_unchanged():
    model, ref = _pair()
    ids, labels = _batch()
    memgrad_hf.patch_model(model)
    model.eval(), ref.eval()
    with torch.no_grad():
        a, b = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.loss, b.loss)
    # skip_logits=True forces the chunked path even in eval (loss only)
    with torch.no_grad():
        c = model(input_ids=ids, labels=labels, skip_logits=True)
    assert c.logits is None and torch.allclose(c.loss, b.loss, rtol=1e-6)
    # and skip_logits=False keeps the full logits in training
    model.train()
    d = model(input_ids=ids, labels=labels, skip_logits=False)
    assert d.logits is not None and d.logits.shape[-1] == VOCAB


def test_greedy_generation_identical():
    model, ref = _pair()
    memgrad_hf.patch_model(model)
    model.eval(), ref.eval()
    ids = torch.randint(1, VOCAB, (2, 5))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_save_pretrained_keys_and_reload_in_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model, ref = _pair()
    memgrad_hf.patch_model(model)
    assert model.state_dict().keys() == ref.state_dict().keys()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (n, p), (_, q) in zip(loaded.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(p, q), n


def test_unpatch_restores_and_double_patch_is_harmless():
    model, ref = _pair()
    original_forward = model.forward
    memgrad_hf.patch_model(model)
    memgrad_hf.patch_model(model, chunk_size=2)  # only updates options
    ids, labels = _batch()
    assert model(input_ids=ids, labels=labels).logits is None
    memgrad_hf.unpatch_model(model)
    assert "forward" not in model.__dict__ and not hasattr(model, "_memgrad_head")
    assert model.forward == original_forward
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None
    torch.manual_seed(1)
    assert torch.equal(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)
    memgrad_hf.unpatch_model(model)  # unpatching an unpatched model is a no-op


def test_a_head_the_chunked_head_refuses_at_forward_is_served_after_the_advised_head_false():
    # a custom head found at the first training forward is refused with "Use patch_model(model, head=False)"; on the
    # model already patched that call changed nothing, and the error came again
    from memgrad_hf.titans import TitansConfig

    class ScaledHead(nn.Module):  # logits through a matmul, not F.linear: the probe cannot reproduce them
        def __init__(self, w):
            super().__init__()
            self.weight = w

        def forward(self, x):
            return 2 * x @ self.weight.t()

    model = memgrad_hf.patch_model(tiny_model("llama"))
    model.lm_head = ScaledHead(model.lm_head.weight)
    ids, labels = _batch()
    with pytest.raises(UnsupportedModelError, match=r"patch_model\(model, head=False\)"):
        model(input_ids=ids, labels=labels)
    memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[0], heads=2, chunk_size=8))
    assert not memgrad_hf.is_head_patched(model) and "forward" not in model.__dict__
    assert model(input_ids=ids, labels=labels).logits is not None  # the model's own head and loss
    assert memgrad_hf.patches.titans.is_titans_patched(model)


def test_deepcopy_of_patched_model_patches_the_copy():
    model, _ = _pair()
    memgrad_hf.patch_model(model)
    clone = copy.deepcopy(model)
    assert clone.forward.__self__ is clone
    ids, labels = _batch()
    assert clone(input_ids=ids, labels=labels).logits is None


def test_a_pickled_patched_model_says_so_and_patches_again(caplog):
    # pickling stores the instance forward by name: the loaded model has its class's forward back
    import pickle

    from memgrad_hf.patches import is_head_patched

    model, _ = _pair()
    memgrad_hf.patch_model(model)
    loaded = pickle.loads(pickle.dumps(model))
    ids, labels = _batch()
    with caplog.at_level("WARNING", logger="memgrad_hf.patches.head"):
        assert not is_head_patched(loaded)
    assert "patch_model(model) again" in caplog.text
    assert loaded(input_ids=ids, labels=labels).logits is not None  # honest: full logits, as stock
    memgrad_hf.patch_model(loaded)
    assert is_head_patched(loaded) and loaded(input_ids=ids, labels=labels).logits is None
    assert torch.equal(loaded(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss)
    again = pickle.loads(pickle.dumps(model))
    memgrad_hf.unpatch_model(again)  # unpatching one is clean too
    assert "forward" not in again.__dict__ and not hasattr(again, "_memgrad_head")


def test_gradient_checkpointing():
    model, ref = _pair()
    for m in (model, ref):
        enable_checkpointing(m)
    ids, labels = _batch()
    ref_out, ref_g = _loss_and_grads(ref, ids, labels)
    memgrad_hf.patch_model(model)
    out, g = _loss_and_grads(model, ids, labels)
    _assert_same(out, g, ref_out, ref_g)


def test_no_tokens_by_vocab_tensor_in_model_forward_and_backward():
    model = tiny_model("llama", vocab_size=4096).train()
    ids = torch.randint(1, 4096, (4, 64))
    memgrad_hf.patch_model(model, chunk_size=16)
    with LargestTensor() as mode:
        model(input_ids=ids, labels=ids).loss.backward()
    n_tokens = ids.numel()
    assert mode.max_numel <= 16 * 4096 * 2 < n_tokens * 4096, (mode.max_numel, mode.op)


def test_bf16_model_close_to_unpatched():
    model, ref = _pair()
    model, ref = model.to(torch.bfloat16), ref.to(torch.bfloat16)
    ids, labels = _batch(4, 16)
    ref_out, ref_g = _loss_and_grads(ref, ids, labels)
    memgrad_hf.patch_model(model, chunk_size=8)
    out, g = _loss_and_grads(model, ids, labels)
    # Stated bf16 tolerance: the loss to 1e-3 relative (fp32 softmax over bf16 logits in both), gradients to 3e-2
    # of each tensor's scale (one bf16 rounding, 2^-8, propagated through the backbone).
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-3 * abs(ref_out.loss.item())
    for n, x in g.items():
        r = ref_g[n].float()
        assert (x.float() - r).abs().max() <= 3e-2 * r.abs().max() + 1e-3, n


def test_autocast_training_matches_unpatched():
    model, ref = _pair()
    ids, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out, ref_g = _loss_and_grads(ref, ids, labels)
        memgrad_hf.patch_model(model)
        out, g = _loss_and_grads(model, ids, labels)
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-3 * abs(ref_out.loss.item())
    for n, x in g.items():
        assert (x - ref_g[n]).abs().max() <= 3e-2 * ref_g[n].abs().max() + 1e-4, n


# ----------------------------------------------------------------------------------------------- PEFT


@pytest.mark.parametrize("dropout,lora_bias", [(0.0, False), (0.1, False), (0.0, True)])
def test_peft_lora_including_lm_head_trains_exactly(dropout, lora_bias):
    # lora_bias: PEFT scales lora_B's bias with its output (it was added unscaled: loss 6.6e-3 off)
    from peft import LoraConfig, get_peft_model

    base, base_ref = _pair()
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj", "lm_head"],
                     lora_bias=lora_bias)
    model, ref = get_peft_model(base, cfg), get_peft_model(base_ref, copy.deepcopy(cfg))
    ref.load_state_dict(model.state_dict())
    for m in (model, ref):  # make lora_B non-zero so the head's adapter changes the logits
        for n, p in m.named_parameters():
            if "lora_B" in n:
                torch.manual_seed(hash(n) % 1000)
                nn.init.normal_(p, std=0.1)
    memgrad_hf.patch_model(model, chunk_size=4)
    ids, labels = _batch()
    ref_out, ref_g = _loss_and_grads(ref, ids, labels)
    out, g = _loss_and_grads(model, ids, labels)
    _assert_same(out, g, ref_out, ref_g)
    head_lora = [n for n in g if "lm_head" in n and "lora" in n]
    assert head_lora and all(g[n].abs().max() > 0 for n in head_lora)


def test_peft_modules_to_save_lm_head_trains_exactly():
    from peft import LoraConfig, get_peft_model

    base, base_ref = _pair()
    cfg = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    model, ref = get_peft_model(base, cfg), get_peft_model(base_ref, copy.deepcopy(cfg))
    ref.load_state_dict(model.state_dict())
    memgrad_hf.patch_model(model)
    ids, labels = _batch()
    ref_out, ref_g = _loss_and_grads(ref, ids, labels)
    out, g = _loss_and_grads(model, ids, labels)
    _assert_same(out, g, ref_out, ref_g)
    assert any("modules_to_save" in n and "lm_head" in n for n in g)


def test_peft_dora_on_lm_head_is_refused_with_the_fix():
    # DoRA's weight norm is not a LoRA delta the chunked head can fold into the weight: refused by patch_model where
    # the adapter exists already, and at the first training forward where PEFT wraps a patched model; DoRA elsewhere,
    # and patch_model(model, head=False), train as stock
    from peft import LoraConfig, get_peft_model

    ids, labels = _batch()
    cfg = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], use_dora=True)
    with pytest.raises(UnsupportedModelError, match=r"DoraLinearVariant.*head=False"):
        memgrad_hf.patch_model(get_peft_model(_pair()[0], copy.deepcopy(cfg)))
    late = get_peft_model(memgrad_hf.patch_model(_pair()[0]), copy.deepcopy(cfg))
    with pytest.raises(UnsupportedModelError, match=r"DoraLinearVariant.*head=False"):
        late(input_ids=ids, labels=labels)
    base, base_ref = _pair()
    cfg = LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    model, ref = get_peft_model(base, cfg), get_peft_model(base_ref, copy.deepcopy(cfg))
    ref.load_state_dict(model.state_dict())
    memgrad_hf.patch_model(model)
    ref_out, ref_g = _loss_and_grads(ref, ids, labels)
    out, g = _loss_and_grads(model, ids, labels)
    _assert_same(out, g, ref_out, ref_g)


def test_peft_trainable_tokens_on_a_tied_head_is_refused_by_patch_model():
    # trainable_token_indices on tied embeddings wraps the output embeddings too (TrainableTokensWrapper): refused
    # by patch_model itself, naming the fix, which trains
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[1, 2])
    model = get_peft_model(tiny_model("llama", tied=True), cfg)
    with pytest.raises(UnsupportedModelError, match=r"TrainableTokensWrapper.*head=False"):
        memgrad_hf.patch_model(model)
    ids, labels = _batch()
    memgrad_hf.patch_model(model, head=False)(input_ids=ids, labels=labels).loss.backward()


# ----------------------------------------------------------------------------------------------- errors


def test_unsupported_models_raise_named_errors():
    from transformers import LlamaModel

    backbone = LlamaModel(tiny_model("llama").config)
    with pytest.raises(UnsupportedModelError, match="LlamaModel"):
        memgrad_hf.patch_model(backbone)
    with pytest.raises(UnsupportedModelError, match="nn.Module"):
        memgrad_hf.patch_model("not a model")
    with pytest.raises(UnsupportedModelError, match=r"torch.compile's wrapper.*patch the model before compiling"):
        memgrad_hf.patch_model(torch.compile(tiny_model("llama")))  # (torch.compile's wrapper: no compilation yet)
    patched = memgrad_hf.patch_model(tiny_model("llama"))
    patched.lm_head = type("Wrapped", (torch.nn.Module,), {})()  # a head without a weight, swapped in later
    with pytest.raises(UnsupportedModelError, match=r"\(Wrapped\) have no 2-D weight.*unpatch_model"):
        patched(torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 4, dtype=torch.long))
    from transformers import LlamaForSequenceClassification

    reward_model = LlamaForSequenceClassification(tiny_model("llama").config)
    with pytest.raises(UnsupportedModelError, match=r"scoring head.*head=False") as err:
        memgrad_hf.patch_model(reward_model)
    assert "bare backbone" not in str(err.value)  # (the backbone's advice read oddly for a classifier)
    with pytest.raises(UnsupportedModelError, match="bare backbone"):
        memgrad_hf.patch_model(backbone)

    model = tiny_model("llama")
    model.loss_function = lambda *a, **k: None
    with pytest.raises(UnsupportedModelError, match="custom loss_function"):
        memgrad_hf.patch_model(model)


def test_one_dimensional_labels_of_a_single_sequence_as_stock():
    # stock flattens labels and logits, so labels of shape (T,) for a batch of one work; they were refused
    model, ref = _pair()
    memgrad_hf.patch_model(model)
    ids, labels = _batch(b=1)
    ref_out, ref_g = _loss_and_grads(ref, ids, labels[0])
    out, g = _loss_and_grads(model, ids, labels[0])
    _assert_same(out, g, ref_out, ref_g)
    with pytest.raises(ValueError, match="shaped like input_ids"):
        model(input_ids=ids, labels=labels[0, :-2])


@pytest.mark.parametrize("change", ["loss_function", "loss_type", "masked_lm_loss_type"])
def test_a_loss_set_after_patching_is_honoured_with_a_warning(change, caplog, monkeypatch):
    # set after patch_model the model's loss was bypassed: a custom loss gave plain cross-entropy (10.2 vs 4.6). A
    # loss the chunked head serves (the masked LM's, on unshifted labels) is served, without a warning.
    from transformers.loss.loss_utils import LOSS_MAPPING

    monkeypatch.setitem(LOSS_MAPPING, "ForTest", lambda logits, labels, vocab_size, **kw: logits.square().mean())
    model, ref = _pair()
    memgrad_hf.patch_model(model)
    for m in (model, ref):
        if change == "loss_function":
            m.loss_function = lambda logits, labels, vocab_size, **kw: 2 * logits.float().logsumexp(-1).mean()
        else:
            m.loss_type = "ForTest" if change == "loss_type" else "ForMaskedLM"
    ids, labels = _batch()
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.patches.head"):
        ref_out, ref_g = _loss_and_grads(ref, ids, labels)
        out, g = _loss_and_grads(model, ids, labels)
        _loss_and_grads(model, ids, labels)
    _assert_same(out, g, ref_out, ref_g)
    assert caplog.text.count("set after patch_model") == (change != "masked_lm_loss_type")
    assert (out.logits is None) == (change == "masked_lm_loss_type")


def test_unknown_logit_rewrite_is_refused_not_silently_dropped():
    from transformers import LlamaForCausalLM

    class SquaredLogits(LlamaForCausalLM):  # a model whose head does something we cannot model
        def forward(self, input_ids=None, labels=None, **kwargs):
            h = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(h).pow(2)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            return {"loss": loss, "logits": logits}

    model = SquaredLogits(tiny_model("llama").config).train()
    memgrad_hf.patch_model(model)
    ids, labels = _batch()
    with pytest.raises(UnsupportedModelError, match=r"SquaredLogits.*pow"):
        model(input_ids=ids, labels=labels)


def _own_loss_model(select: str):
    """A causal LM computing its own cross-entropy on positions it picks from the logits (as qwen2_audio and
    granite_speech do with their attention mask), per ``select``."""
    from transformers import LlamaForCausalLM

    class OwnSelection(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state)
            if select == "mask":  # qwen2_audio's loss
                keep = attention_mask[..., 1:] != 0
                logits, labels = logits[..., :-1, :][keep].contiguous(), labels[..., 1:][keep]
            elif select == "index":  # positions by integer index, along the tokens
                at = torch.tensor([4, 0, 2, 2])
                logits, labels = logits[:, at], labels[:, at + 1]
            elif select == "last":  # one position per row
                logits, labels = logits[:, -2], labels[:, -1]
            elif select == "flip":  # not a selection: refused
                logits, labels = logits.flip(1), labels
            elif select == "vocab_index":  # picks vocabulary entries: refused
                logits = logits[..., torch.arange(0, VOCAB, 2)]
                labels = labels.clamp(max=0) + labels // 2
            loss = nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            return {"loss": loss, "logits": logits}

    return OwnSelection(tiny_model("llama").config).train()


@pytest.mark.parametrize("select", ["mask", "index", "last"])
def test_positions_a_model_selects_from_its_logits_are_taken_from_the_hidden_states(select):
    # was refused (`aten.slice.Tensor` on the token axis): qwen2_audio and granite_speech (the seq2seq sweep)
    model = _own_loss_model(select)
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model, chunk_size=3)
    ids, labels = _batch(3, 9)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, :2] = 0
    outs = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, attention_mask=mask, labels=labels)["loss"]
        loss.backward()
        outs.append((loss, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (ref_loss, ref_g), (loss, g) = outs
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert g.keys() == ref_g.keys()
    for n, grad in g.items():
        assert (grad - ref_g[n]).abs().max() <= 1e-5 * ref_g[n].abs().max() + 1e-7, n


@pytest.mark.parametrize("select,op", [("flip", "flip"), ("vocab_index", "index")])
def test_logit_ops_that_are_not_position_selections_are_refused(select, op):
    model = _own_loss_model(select)
    memgrad_hf.patch_model(model)
    ids, labels = _batch()
    with pytest.raises(UnsupportedModelError, match=op):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def test_an_input_embedding_given_as_the_output_embeddings_is_refused_by_name():
    # fsmt's get_output_embeddings() is its decoder's nn.Embedding (the logits come from another module): the probe
    # used to replace the input embedding's output and fail later on an unrelated op (`aten.add_`)
    from transformers import LlamaForCausalLM

    class EmbeddingAsHead(LlamaForCausalLM):
        def get_output_embeddings(self):
            return self.model.embed_tokens

    model = EmbeddingAsHead(tiny_model("llama").config)
    with pytest.raises(UnsupportedModelError, match=r"EmbeddingAsHead.get_output_embeddings\(\) returns an nn.Embed"):
        memgrad_hf.patch_model(model)
    memgrad_hf.patch_model(model, head=False)  # the rest of memgrad still applies


def test_bad_arguments_raise_value_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="Titans"):
        memgrad_hf.patch_model(model, titans=object())
    with pytest.raises(ValueError, match="chunk_size"):
        memgrad_hf.patch_model(model, chunk_size=-1)
    with pytest.raises(ValueError, match="accum_dtype"):
        memgrad_hf.patch_model(model, accum_dtype=torch.int8)
    with pytest.raises(ValueError, match="grad_in_forward"):
        memgrad_hf.patch_model(model, grad_in_forward="no")
    # the weight's own dtype is allowed, fp64 included (was refused by a message saying it was allowed)
    fp64 = memgrad_hf.patch_model(tiny_model("llama").double(), accum_dtype=torch.float64)
    ids = torch.randint(1, 50, (2, 6))
    ref = tiny_model("llama").double()(ids, labels=ids).loss
    assert torch.allclose(fp64(ids, labels=ids).loss.double(), ref.double(), rtol=1e-6)


def test_grad_in_forward_false_recomputes_the_logits_in_backward():
    # An fp32 model computes the head's gradients in forward by default: they are handed to the first backward
    # only, so a second backward through the same graph is refused. With grad_in_forward=False the logits are
    # recomputed in each backward: both backwards run, and the gradients are the unpatched model's, twice.
    ids, labels = _batch()
    model, ref = _pair()
    memgrad_hf.patch_model(model)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"patch_model\(model, grad_in_forward=False\)"):
        loss.backward()
    model, ref = _pair()
    memgrad_hf.patch_model(model, grad_in_forward=False)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward(retain_graph=True)
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=labels).loss
    (2 * ref_loss).backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    memgrad_hf.patch_model(model)  # patching again resets the option
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time") as e:
        loss.backward()
    assert "head_grad=recompute" in str(e.value)  # a FORGE user's fix (its option decides there)


@pytest.mark.slow
def test_torch_compile_of_patched_model_matches():
    model, ref = _pair()
    ids, labels = _batch()
    memgrad_hf.patch_model(model)
    compiled = torch.compile(model)
    out = compiled(input_ids=ids, labels=labels)
    out.loss.backward()
    ref_out = ref(input_ids=ids, labels=labels)
    ref_out.loss.backward()
    assert torch.allclose(out.loss, ref_out.loss, rtol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_an_offloaded_head_is_refused_with_the_fix():
    # accelerate's cpu/disk offload (device_map) leaves the weight on "meta" between calls; its pre-forward hook, which
    # loads it, wraps the forward the probe replaces
    from accelerate import cpu_offload

    model = tiny_model("llama").train()
    cpu_offload(model.lm_head, execution_device=torch.device("cpu"))
    memgrad_hf.patch_model(model)
    ids, labels = _batch()
    with pytest.raises(UnsupportedModelError, match="offloaded.*device_map"):
        model(input_ids=ids, labels=labels)


def test_a_gradient_penalty_on_a_patched_model_is_refused_and_skip_logits_false_computes_it():
    base, ref = _pair()
    memgrad_hf.patch_model(base)
    ids, labels = _batch()

    def penalty(model, **kw):
        loss = model(input_ids=ids, labels=labels, **kw).loss
        (g,) = torch.autograd.grad(loss, model.model.norm.weight, create_graph=True)
        return loss + g.square().sum()

    with pytest.raises(RuntimeError, match="skip_logits=False"):
        penalty(base)
    ours = torch.autograd.grad(penalty(base, skip_logits=False), base.lm_head.weight)[0]
    theirs = torch.autograd.grad(penalty(ref), ref.lm_head.weight)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_a_model_that_skips_its_loss_for_these_labels_is_told_apart_from_an_unsupported_one():
    # BertForPreTraining computes a loss only with next_sentence_label too; given labels alone it returns none, and
    # the patched model blamed its loss mechanism and told to unpatch (with both labels it is exact)
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    stock = BertForPreTraining(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                          intermediate_size=64, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))
    patched = memgrad_hf.patch_model(copy.deepcopy(stock))
    ids = torch.randint(7, 64, (2, 8))
    labels = torch.full((2, 8), -100)
    labels[:, 2] = ids[:, 2]
    both = dict(input_ids=ids, labels=labels, next_sentence_label=torch.tensor([0, 1]))
    assert torch.allclose(patched(**both).loss, stock(**both).loss, rtol=1e-6)
    with pytest.raises(ValueError, match="returned no loss.*skip_logits=False"):
        patched(input_ids=ids, labels=labels)
    out = patched(input_ids=ids, labels=labels, skip_logits=False)
    ref = stock(input_ids=ids, labels=labels)
    assert out.loss is None and torch.equal(out.prediction_logits, ref.prediction_logits)


def test_skip_logits_without_labels_says_the_logits_are_built(caplog):
    # nothing to chunk without labels: the full logits come back as stock's, and a warning says so once (was silent)
    import logging

    model = memgrad_hf.patch_model(tiny_model("llama"))
    ids = torch.randint(1, 50, (1, 5))
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        out = model(input_ids=ids, skip_logits=True)
        model(input_ids=ids, skip_logits=True)
    assert out.logits.shape == (1, 5, model.config.vocab_size)
    assert caplog.text.count("skip_logits=True) without labels") == 1
