"""memgrad_hf.grpo.add_fused_lm_head against TRL's own add_fused_lm_head (fp32): outputs and every gradient."""

import copy

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head

import memgrad_hf
from memgrad_hf.grpo import add_fused_lm_head
from tests.tiny_models import VOCAB, tiny_model, with_word_scaled_head


def _run(model, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True, **kw)
    g1 = torch.linspace(-1, 1, out.log_probs.numel()).reshape(out.log_probs.shape)
    obj = (out.log_probs * g1).sum() + out.loss
    if out.entropy is not None:
        obj = obj + 0.3 * (out.entropy * g1.flip(-1)).sum()
    obj.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "cohere"])
@pytest.mark.parametrize("outputs", [("log_probs",), ("log_probs", "entropy"),
                                     ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")])
def test_matches_trl_fused_head(family, outputs):
    model = tiny_model(family).train()
    ref = copy.deepcopy(model)
    add_fused_lm_head(model, temperature=0.7, outputs=outputs)
    trl_add_fused_lm_head(ref, temperature=0.7, outputs=outputs)
    ids = torch.randint(1, VOCAB, (2, 10))
    labels = ids.clone()
    labels[0, :4] = -100  # prompt positions
    a, ga = _run(model, ids, labels)
    b, gb = _run(ref, ids, labels)
    assert torch.equal(a.label_mask, b.label_mask)
    assert torch.allclose(a.log_probs, b.log_probs, rtol=1e-5, atol=1e-6)
    assert torch.allclose(a.loss, b.loss, rtol=1e-5)
    if "entropy" in outputs:
        assert torch.allclose(a.entropy, b.entropy, rtol=1e-5, atol=1e-6)
    for field in ("log_sum_sq_probs", "mean_logits"):
        if field in outputs:
            assert torch.allclose(getattr(a, field), getattr(b, field), rtol=1e-5, atol=1e-6), field
    if "is_top1" in outputs:
        assert torch.equal(a.is_top1, b.is_top1)
    assert ga.keys() == gb.keys()
    scale = max(g.abs().max().item() for g in gb.values())
    for n in ga:
        assert (ga[n] - gb[n]).abs().max().item() <= 1e-5 * gb[n].abs().max().item() + 1e-6 * scale, n


def _ours_and_trls():
    """A tiny Llama with memgrad's fused head and a copy with TRL's."""
    model = tiny_model("llama").train()
    ref = copy.deepcopy(model)
    add_fused_lm_head(model)
    trl_add_fused_lm_head(ref)
    return model, ref


def test_shift_labels_and_plain_forward_passthrough():
    model, ref = _ours_and_trls()
    ids = torch.randint(1, VOCAB, (2, 8))
    shift = torch.randint(0, VOCAB, (2, 8))
    shift[:, -1] = -100
    a = model(input_ids=ids, shift_labels=shift, fused_lm_head=True)
    b = ref(input_ids=ids, shift_labels=shift, fused_lm_head=True)
    assert torch.allclose(a.log_probs, b.log_probs, rtol=1e-5, atol=1e-6)
    plain = model(input_ids=ids, labels=ids)  # without the flag: the original forward, with logits
    assert plain.logits is not None and plain.logits.shape[-1] == VOCAB
    # shift_labels one short (labels[:, 1:], what the labels error's hint was read as) is named, not an internal
    # "token_ids shape must equal hidden's" error about arguments the caller never passed
    with pytest.raises(ValueError, match="shift_labels cover 7 positions .* with -100 appended"):
        model(input_ids=ids, shift_labels=shift[:, 1:], fused_lm_head=True)


def test_logits_to_keep_and_return_dict_are_taken_as_trls_head_takes_them_and_bad_labels_are_named():
    # logits_to_keep with full-length labels failed with a shape error that named neither; return_dict=False was
    # called an unsupported model; missing / 1-D / pre-shifted labels gave TypeError / IndexError / a wrong hint
    model, ref = _ours_and_trls()
    ids = torch.randint(1, VOCAB, (2, 10))
    labels = ids.clone()
    labels[:, :6] = -100  # only the last 4 tokens scored, as a loop with logits_to_keep=5 would ask
    a = model(input_ids=ids, labels=labels, logits_to_keep=5, fused_lm_head=True)
    b = ref(input_ids=ids, labels=labels, logits_to_keep=5, fused_lm_head=True)
    assert a.log_probs.shape == b.log_probs.shape == (2, 9)
    assert torch.allclose(a.log_probs, b.log_probs, rtol=1e-5, atol=1e-6)
    c = model(input_ids=ids, labels=labels, fused_lm_head=True, return_dict=False)
    assert torch.allclose(c.log_probs, a.log_probs, rtol=1e-6, atol=1e-7)
    for bad, said in ((None, "pass labels"), (ids[0], r"must be \[batch, seq\]"), (ids[:, 1:], "unshifted labels")):
        with pytest.raises(ValueError, match=said):
            model(input_ids=ids, labels=bad, fused_lm_head=True)


def test_unsupported_outputs_are_refused():
    with pytest.raises(ValueError, match="logits"):
        add_fused_lm_head(tiny_model("llama"), outputs=("log_probs", "logits"))


def _objective(log_probs, entropy, mask):
    g1 = torch.linspace(-1, 1, log_probs.numel()).reshape(log_probs.shape)
    return (log_probs * g1).sum() - log_probs.sum() / mask.sum() + 0.3 * (entropy * g1.flip(-1)).sum()


@pytest.mark.parametrize("family,extra", [
    ("gemma4_text", {}),  # sliding/full attention, per-layer inputs, final-logit softcapping
    ("qwen3_next", {}),  # hybrid linear attention + MoE
    ("bert", {"is_decoder": True}),  # a head transform (dense + act + LayerNorm) between the backbone and lm_head
    ("granite", {}),  # logits divided by logits_scaling
    ("gemma2", {"word_scaled_head": True}),  # a head module scaling each word's logit by a learned parameter
])
def test_equals_the_models_own_logits(family, extra):
    # The head's input and the rewrites of the logits are observed in the model's own forward (no per-family table):
    # log-probs, entropies and every gradient equal those computed from the model's full logits.
    extra = dict(extra)
    scaled = extra.pop("word_scaled_head", False)
    model = tiny_model(family, **extra).train()
    model = with_word_scaled_head(model) if scaled else model
    ref = copy.deepcopy(model)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids = torch.randint(1, VOCAB, (2, 10))
    labels = ids.clone()
    labels[0, :4] = -100
    mask = labels[:, 1:] != -100
    torch.manual_seed(0)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    _objective(out.log_probs, out.entropy, mask).backward()
    torch.manual_seed(0)
    logp_all = (ref(input_ids=ids).logits[:, :-1].float() / 0.7).log_softmax(-1)
    log_probs = logp_all.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0] * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    _objective(log_probs, entropy, mask).backward()
    assert torch.allclose(out.log_probs, log_probs, rtol=1e-5, atol=1e-6)
    assert torch.allclose(out.entropy, entropy, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    for n, g in ref_grads.items():
        assert (grads[n] - g).abs().max().item() <= 1e-5 * g.abs().max().item() + 1e-6 * scale, n


def test_logit_ops_the_kernels_cannot_reproduce_are_refused():
    from transformers import LlamaForCausalLM

    from memgrad_hf import UnsupportedModelError

    class NormalizedLlama(LlamaForCausalLM):  # rewrites its logits in a way no epilogue expresses
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = torch.log_softmax(out.logits, -1)
            return out

    model = NormalizedLlama(tiny_model("llama").config)
    add_fused_lm_head(model)
    ids = torch.randint(1, VOCAB, (1, 6))
    with pytest.raises(UnsupportedModelError, match="log_softmax"):
        model(input_ids=ids, labels=ids, fused_lm_head=True)


def test_vision_language_model_with_an_image():
    # TRL scores VLM completions with pixel inputs: the model's own forward runs, so the image path is its own.
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlavaConfig

    from tests.tiny_models import tiny_config

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        LlavaConfig(vision_config=vision, text_config=tiny_config("llama"), image_token_index=VOCAB - 1)).eval()
    ids = torch.randint(1, VOCAB - 2, (2, 10))
    ids[:, 1:5] = VOCAB - 1  # 4 image tokens per row
    labels = ids.clone()
    labels[:, :5] = -100
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        logp = model(input_ids=ids, pixel_values=pixels).logits[:, :-1].log_softmax(-1)
        mask = labels[:, 1:] != -100
        want = logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0] * mask
        add_fused_lm_head(model)
        got = model(input_ids=ids, pixel_values=pixels, labels=labels, fused_lm_head=True)
    assert torch.equal(got.label_mask, mask)
    assert torch.allclose(got.log_probs, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("install", [trl_add_fused_lm_head, add_fused_lm_head], ids=["trl", "memgrad"])
def test_patch_model_under_an_installed_fused_head_is_refused_with_the_fix(install):
    # a TRL trainer built before patch_model has put its fused head on model.forward; memgrad's head cannot go under it
    import memgrad_hf
    from memgrad_hf import UnsupportedModelError

    model = tiny_model("llama").train()
    install(model)
    with pytest.raises(UnsupportedModelError, match="before building the TRL trainer"):
        memgrad_hf.patch_model(model)


def test_unpatch_model_under_a_later_fused_head_keeps_it_and_restores_stock_behaviour():
    import memgrad_hf
    from memgrad_hf.patches import is_head_patched

    model = tiny_model("llama").train()
    ref = copy.deepcopy(model)
    memgrad_hf.patch_model(model)
    add_fused_lm_head(model)  # what a TRL trainer does to a patch_model()ed model
    add_fused_lm_head(ref)
    memgrad_hf.unpatch_model(model)
    assert not is_head_patched(model)
    ids = torch.randint(1, VOCAB, (2, 9))
    got, want = model(input_ids=ids, labels=ids, fused_lm_head=True), ref(input_ids=ids, labels=ids, fused_lm_head=True)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=0)
    plain, stock = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert plain.logits is not None  # the chunked head no longer runs
    torch.testing.assert_close(plain.loss, stock.loss, rtol=0, atol=0)
    memgrad_hf.patch_model(model)  # and can be patched again
    assert is_head_patched(model) and model(input_ids=ids, labels=ids).logits is None


def test_patch_model_settings_reach_the_fused_head():
    # TRL's trainers score a patch_model()ed model through the fused head: its chunk_size is honoured there too
    from tests.helpers import LargestTensor

    ids = torch.randint(1, VOCAB, (2, 40))
    largest = []
    for chunk_size in (None, 4):
        model = tiny_model("llama").train()
        memgrad_hf.patch_model(model, chunk_size=chunk_size)
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        with LargestTensor() as lt:
            _run(model, ids, ids)
        largest.append(lt.max_numel)
    assert largest[0] >= 2 * 39 * VOCAB  # the automatic chunk takes these 78 tokens at once
    assert largest[1] <= 64 * VOCAB  # (the weights and their gradients, 32 x 101, are the next largest)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["no_clip", "exact_clip"])
def test_forge_updates_the_head_in_vocabulary_blocks_through_the_fused_head(monkeypatch, max_grad_norm, dtype):
    # FORGE takes the head weight's gradient from the fused head (TRL's GRPO / SFT / DPO path) in vocabulary blocks,
    # as from the patched model's own loss: it never exists, and the weights equal torch.optim.AdamW's
    from memgrad_hf.kernels import head as KH
    from memgrad_hf.optim import ForgeAdamW

    walks = []
    real_walk = KH.head_backward_vocab_blocks
    monkeypatch.setattr(KH, "head_backward_vocab_blocks", lambda *a, **k: (walks.append(1), real_walk(*a, **k))[1])
    model = memgrad_hf.patch_model(tiny_model("llama").to(dtype).train())
    ref = copy.deepcopy(model)
    for m in (model, ref):
        add_fused_lm_head(m, temperature=0.7, outputs=("log_probs", "entropy"))
    grads = []  # (registered before FORGE's own hook: sees a gradient before FORGE would apply and drop it)
    model.lm_head.weight.register_post_accumulate_grad_hook(lambda p: grads.append(p.grad))
    # The head's vocabulary-block backward sums the hidden-state gradient in another order than its token-chunk one.
    # AdamW's g / (|g| + eps) multiplies that last-bit difference by up to lr / eps on elements whose gradient cancels
    # to ~0 (fp32: measured up to 1e-4 * lr on the embedding, CPU-dependent); fp64 shows the math itself is exact.
    hp = dict(lr=1e-2, weight_decay=0.1, eps=1e-4)
    rel, noise = (1e-10, 1e-12) if dtype == torch.float64 else (1e-5, 5e-4 * hp["lr"])
    opt = ForgeAdamW(model.parameters(), model=model, max_grad_norm=max_grad_norm, **hp)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp)
    for step in range(3):
        ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            out = m(input_ids=ids, labels=ids, fused_lm_head=True)
            adv = torch.linspace(-1, 1, out.log_probs.numel(), dtype=dtype).reshape(out.log_probs.shape)
            loss = -(out.log_probs * adv).mean() - 0.1 * out.entropy.mean()
            if o is opt:
                opt.backward(loss)
            else:
                loss.backward()
                if max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
            o.step()
            o.zero_grad()
    opt.detach()
    assert walks and all(g is None for g in grads)  # the head's gradient went to FORGE in blocks, never whole
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = (a - b).abs().max().item()
        assert err <= rel * b.abs().max().item() + noise, (name, err)
