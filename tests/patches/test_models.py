"""patch_model on many transformers families: loss and every parameter gradient equal the unpatched model."""

import copy

import pytest
import torch

import memgrad_hf
from memgrad_hf.patches.quirks import epilogue_from_config
from tests.tiny_models import FAMILIES, VOCAB, tiny_model, with_word_scaled_head


def _loss_and_grads(model, ids, labels, seed=1, **kw):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in both runs
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(out, grads, ref_out, ref_grads, rtol=1e-5):
    assert abs(out.loss.item() - ref_out.loss.item()) <= rtol * abs(ref_out.loss.item())
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    for name, g in grads.items():
        r = ref_grads[name]
        # relative per tensor; the absolute floor covers gradients that are 0 up to rounding (e.g. k_proj biases)
        err = (g - r).abs().max().item()
        assert err <= rtol * r.abs().max().item() + 1e-6 * scale, (name, err, r.abs().max().item())


def _patched_equals_unpatched(model):
    """Patch ``model`` (4-token chunks) after copying it; its training loss and every gradient must equal the
    unpatched copy's. Returns ``(unpatched copy, input ids, patched output, patched gradients)``."""
    ref = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    ref_out, ref_grads = _loss_and_grads(ref, ids, labels)
    memgrad_hf.patch_model(model, chunk_size=4)
    out, grads = _loss_and_grads(model, ids, labels)
    _assert_same(out, grads, ref_out, ref_grads)
    return ref, ids, out, grads


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_loss_and_grads_match_unpatched(family, tied):
    model = tiny_model(family, tied=tied).train()
    _, _, out, _ = _patched_equals_unpatched(model)
    assert out.logits is None  # no [tokens x vocab] tensor was built
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere", "hyperclovax", "nanochat", "llama", "gemma4_text"])
def test_quirks_table_agrees_with_what_the_forward_does(family):
    """The config table (used by paths that never run the model's head code) matches the traced epilogue."""
    from memgrad_hf.patches import head as H

    model = tiny_model(family).train()
    memgrad_hf.patch_model(model)
    seen = {}
    real = H._chunked_causal_lm_loss

    def spy(model_, head, cap, patch, logits, *a, **k):
        seen["ep"] = logits._chain.epilogue()
        return real(model_, head, cap, patch, logits, *a, **k)

    H._chunked_causal_lm_loss = spy
    try:
        ids = torch.randint(1, VOCAB, (1, 5))
        model(input_ids=ids, labels=ids)
    finally:
        H._chunked_causal_lm_loss = real
    table = epilogue_from_config(model.config)
    assert seen["ep"].tanh == table.tanh
    assert seen["ep"].inp == pytest.approx(table.inp, rel=1e-6)
    assert seen["ep"].out == pytest.approx(table.out, rel=1e-6)


def test_own_cross_entropy_refuses_what_it_cannot_reproduce():
    # bart's decoder applies nn.CrossEntropyLoss to its unshifted logits: served in chunks (test above), but Trainer's
    # label smoothing (which would smooth against shifted labels) cannot be reproduced through it: a clear error.
    from memgrad_hf.patches.head import head_label_smoothing

    model = tiny_model("bart").train()
    memgrad_hf.patch_model(model)
    ids = torch.randint(1, VOCAB, (2, 6))
    with head_label_smoothing(model, 0.1), pytest.raises(memgrad_hf.UnsupportedModelError, match="label_smoothing"):
        model(input_ids=ids, labels=ids)


@pytest.mark.parametrize("family,autocast", [("bart", False), ("bart", True), ("llama", False)])
def test_a_bf16_models_loss_has_stock_dtype(family, autocast):
    # bart's decoder applies nn.CrossEntropyLoss to its bf16 logits: stock's loss is bf16 (the chunked loss was fp32),
    # or fp32 under autocast (its policy for cross_entropy); llama's ForCausalLMLoss upcasts the logits: fp32
    import contextlib

    model = tiny_model(family).to(torch.float32 if autocast else torch.bfloat16).train()
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model, chunk_size=4)
    ids = torch.randint(1, VOCAB, (2, 9))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        torch.manual_seed(1)
        want = ref(input_ids=ids, labels=ids).loss
        torch.manual_seed(1)
        got = model(input_ids=ids, labels=ids).loss
    got.backward()
    assert got.dtype == want.dtype == (torch.bfloat16 if family == "bart" and not autocast else torch.float32)
    # stock's bf16 log-softmax is itself off by up to ~1% here; the chunked loss is computed in fp32, then rounded
    assert got.float().item() == pytest.approx(want.float().item(), rel=2e-2)


@pytest.mark.parametrize("family,bias,post", [
    ("llama", False, None), ("llama", True, None), ("gemma2", False, None),
    ("llama", False, lambda head, z: z * head.word_scale),  # a second scale, the bare Parameter as operand
    ("llama", True, lambda head, z: z + head.word_scale),  # a per-word bias after the scale (folded into the bias)
    ("llama", False, lambda head, z: (z + head.word_scale) * head.word_scale),  # a bias, then scaled again
], ids=["llama", "llama_bias", "gemma2_softcap", "llama_two_scales", "llama_word_bias", "llama_bias_then_scale"])
def test_head_module_with_its_own_forward_is_traced(family, bias, post):
    # an nn.Linear subclass head that scales each word's logit by a learned parameter (then gemma2 softcaps): its
    # forward runs on the probe, the per-word scale folds into the weight rows; loss and every gradient (the scale's
    # included) equal the unpatched model's
    model = with_word_scaled_head(tiny_model(family).train(), bias=bias, post=post)
    ref, ids, out, grads = _patched_equals_unpatched(model)
    assert out.logits is None and "lm_head.word_scale" in grads
    model.eval()  # evaluation runs the head module as it is
    assert torch.equal(model(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("post,op", [
    (lambda head, z: z * 2.0 + head.word_scale, "add"),  # a per-word bias after a scalar scale
    (lambda head, z: torch.tanh(z) * head.word_scale, "mul"),  # a per-word scale after a softcap
    (lambda head, z: z * torch.ones_like(z), "ones_like"),  # a full [tokens x vocab] operand
], ids=["bias_after_scalar_scale", "scale_after_tanh", "full_tensor"])
def test_head_module_ops_the_kernels_cannot_reproduce_are_refused(post, op):
    model = with_word_scaled_head(tiny_model("llama").train(), post=post)
    memgrad_hf.patch_model(model)
    ids = torch.randint(1, VOCAB, (2, 6))
    with pytest.raises(memgrad_hf.UnsupportedModelError, match=op):
        model(input_ids=ids, labels=ids)


@pytest.mark.parametrize("name", ["bart", "marian", "pegasus", "mbart", "t5", "t5_untied"])
def test_seq2seq_for_conditional_generation_matches_unpatched(name):
    # bart-likes add a per-word final_logits_bias to the logits (was refused): folded into the head's bias;
    # t5 scales the decoder output before a tied head, and computes its own cross-entropy
    import transformers

    if name.startswith("t5"):
        config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                       pad_token_id=0, decoder_start_token_id=0, tie_word_embeddings=name == "t5")
        cls = "T5ForConditionalGeneration"
    else:
        cls, cfg = {"bart": ("BartForConditionalGeneration", "BartConfig"), "marian": ("MarianMTModel", "MarianConfig"),
                    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig"),
                    "mbart": ("MBartForConditionalGeneration", "MBartConfig")}[name]
        config = getattr(transformers, cfg)(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                            decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1,
                                            decoder_start_token_id=2)
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).train()
    if hasattr(model, "final_logits_bias"):
        with torch.no_grad():
            model.final_logits_bias.normal_()
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model, chunk_size=4)
    ids = torch.randint(3, VOCAB, (2, 7))
    labels = torch.randint(3, VOCAB, (2, 5))
    labels[0, :2] = -100
    ref_out, ref_grads = _loss_and_grads(ref, ids, labels)
    out, grads = _loss_and_grads(model, ids, labels)
    _assert_same(out, grads, ref_out, ref_grads)
    assert out.logits is None


@pytest.mark.parametrize("name", ["bert", "roberta", "distilbert", "modernbert", "modernbert_sparse"])
def test_masked_lm_matches_unpatched(name):
    # loss_type ForMaskedLM (unshifted labels; was refused) and BERT's own CrossEntropyLoss; modernbert's
    # sparse_prediction gathers the masked positions' hidden states itself, before its head
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=64, pad_token_id=0)
    if name == "distilbert":
        config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                               max_position_embeddings=64, pad_token_id=0)
    elif name.startswith("modernbert"):
        config = transformers.ModernBertConfig(**common, global_attn_every_n_layers=2, local_attention=8,
                                               sparse_prediction=name.endswith("sparse"))
    else:
        config = getattr(transformers, f"{name.capitalize() if name == 'bert' else 'Roberta'}Config")(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForMaskedLM.from_config(config).train()
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model, chunk_size=4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 12), generator=gen)
    labels = torch.full_like(ids, -100)  # a masked-LM batch: targets at a few positions only
    where = torch.rand(ids.shape, generator=gen) < 0.3
    where[0, 1] = True
    labels[where] = torch.randint(3, VOCAB, ids.shape, generator=gen)[where]
    ref_out, ref_grads = _loss_and_grads(ref, ids, labels)
    out, grads = _loss_and_grads(model, ids, labels)
    _assert_same(out, grads, ref_out, ref_grads)
    assert out.logits is None
    model.eval()  # evaluation and inference: the stock logits
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
