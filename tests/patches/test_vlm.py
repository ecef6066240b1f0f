"""patch_model on vision-language models (image-text-to-text): the same generic head patch, exact with images."""

import copy

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, CLIPVisionConfig, LlavaConfig

import memgrad_hf
from tests.tiny_models import VOCAB, tiny_config


def _grads_close(model, ref):
    scale = max(q.grad.abs().max().item() for q in ref.parameters() if q.grad is not None)
    n = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            n += 1
            assert (p.grad - q.grad).abs().max().item() <= 1e-5 * q.grad.abs().max().item() + 1e-6 * scale, name
    return n


def test_llava_with_an_image_equals_unpatched():
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8)
    cfg = LlavaConfig(vision_config=vision, text_config=tiny_config("llama"), image_token_index=VOCAB - 1)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB - 2, (2, 10))
    ids[:, 1:5] = VOCAB - 1  # 4 image tokens per row: a 16x16 image in 8x8 patches
    labels = ids.clone()
    labels[:, :5] = -100
    pixels = torch.randn(2, 3, 16, 16)
    want = ref(input_ids=ids, pixel_values=pixels, labels=labels)
    want.loss.backward()
    memgrad_hf.patch_model(model, chunk_size=4)
    got = model(input_ids=ids, pixel_values=pixels, labels=labels)
    got.loss.backward()
    assert got.logits is None
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * abs(want.loss.item())
    trained = _grads_close(model, ref)
    assert any("vision" in n and p.grad is not None for n, p in model.named_parameters()) and trained > 20


def test_qwen2_5_vl_text_equals_unpatched():
    base = AutoConfig.for_model("qwen2_5_vl")
    text = {**tiny_config("qwen2").to_dict(), "rope_parameters": {"rope_theta": 1e6, "rope_type": "default",
                                                                 "mrope_section": [1, 1, 2]}}
    vision = {**base.vision_config.to_dict(), "depth": 1, "num_heads": 4, "hidden_size": 32, "intermediate_size": 64,
              "out_hidden_size": 32}
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model("qwen2_5_vl", text_config=text, vision_config=vision)).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, VOCAB, (2, 8))
    labels = ids.clone()
    labels[0, :2] = -100
    want = ref(input_ids=ids, labels=labels)
    want.loss.backward()
    memgrad_hf.patch_model(model, chunk_size=4)
    got = model(input_ids=ids, labels=labels)
    got.loss.backward()
    assert got.logits is None
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * abs(want.loss.item())
    _grads_close(model, ref)
