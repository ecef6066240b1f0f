"""Titans injection into HF decoders: step-0 identity, memory state through segments and generate(), gradient
checkpointing, save/load, exact unpatch."""

import copy
import inspect
import json
import logging
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import memgrad_hf
from memgrad_hf.errors import UnsupportedModelError
from memgrad_hf.patches import is_head_patched
from memgrad_hf.patches.titans import find_decoder_layers, is_titans_patched, remove_titans, titans_branches
from memgrad_hf.titans import TitansConfig, from_pretrained, load_titans, save_titans, titans_state_dict
from tests.helpers import enable_checkpointing
from tests.tiny_models import VOCAB, tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
CFG = dict(heads=2, chunk_size=4, max_lr=0.5)


def _ids(batch=2, n=11, seed=1):
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _activate(model, std=0.5):
    """Give the zero-initialised output projections values, so the memory changes the model's outputs."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for branch in titans_branches(model).values():
            branch.out.weight.copy_(torch.randn(branch.out.weight.shape, generator=g) * std)
    return model


def _patched(family="llama", layers=(-1,), head=False, **kw):
    model = tiny_model(family).eval()
    return memgrad_hf.patch_model(model, head=head, titans=TitansConfig(layers=list(layers), **{**CFG, **kw}))


def _cache(model, cache):
    """The KV-cache keyword of this transformers version (``cache`` since 5.24, ``past_key_values`` before)."""
    return {("cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"): cache}


def _greedy_loop(model, ids, steps):
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("family", FAMILIES)
def test_step0_identity_then_exact_unpatch(family):
    model = tiny_model(family).eval()
    ids = _ids()
    keys = list(model.state_dict())
    with torch.no_grad():
        ref = model(ids).logits
        memgrad_hf.patch_model(model, titans=TitansConfig(layers=[0, -1], **CFG))
        out = model(ids, output_hidden_states=True)
    assert torch.equal(out.logits, ref)  # W_o = 0: identical, not just close
    name, layers = find_decoder_layers(model)
    assert name == "model.layers" and "forward" in layers[1].__dict__
    extra = [k for k in model.state_dict() if k not in keys]
    assert [k for k in model.state_dict() if k in keys] == keys  # original keys unchanged, in order
    prefixes = ("model.layers.0.titans_memory.", "model.layers.1.titans_memory.")
    assert extra and all(k.startswith(prefixes) for k in extra)
    assert model.config.memgrad_titans["layers"] == [0, 1]
    with torch.no_grad():
        changed = _activate(model)(ids, output_hidden_states=True)
    assert not torch.allclose(changed.logits, ref, atol=1e-3)  # the memory reaches the outputs
    # output_hidden_states records the patched layer's output (layer + memory)
    assert not torch.equal(changed.hidden_states[1], out.hidden_states[1])
    memgrad_hf.unpatch_model(model)
    assert not is_titans_patched(model) and not hasattr(model.config, "memgrad_titans")
    assert list(model.state_dict()) == keys
    assert all("forward" not in layer.__dict__ and not hasattr(layer, "titans_memory") for layer in layers)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_cached_equals_uncached_and_resets(family):
    model = _activate(_patched(family, layers=(0, 1)))
    ids = _ids(n=6)  # chunk 4: the prompt leaves 2 pending tokens, decoding crosses several chunk boundaries
    kw = dict(max_new_tokens=9, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kw)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kw))
    assert torch.equal(cached, _greedy_loop(model, ids, 9))
    assert torch.equal(cached, model.generate(ids, use_cache=True, **kw))  # state reset between sequences


def test_generate_in_train_mode_with_checkpointing_keeps_the_memory():
    # generate() runs under no_grad: transformers then neither checkpoints a layer nor drops its KV cache, and the
    # memory must follow the cache too (a Trainer callback, or GRPO-style sampling, from a model in train mode)
    model = _activate(_patched("llama", layers=(0, 1)))
    ids = _ids(n=6)
    kw = dict(max_new_tokens=9, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, use_cache=True, **kw)  # eval mode
    enable_checkpointing(model)
    model.train()
    assert torch.equal(model.generate(ids, use_cache=True, **kw), expected)
    assert torch.equal(model.generate(ids, use_cache=False, **kw), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_segments_through_a_cache_equal_one_forward(family):
    model = _activate(_patched(family))
    ids = _ids(n=13)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        for _ in range(2):  # a fresh cache starts a new sequence: same result the second time
            cache = DynamicCache(config=model.config)
            parts = [model(ids[:, s:e], **_cache(model, cache), use_cache=True).logits
                     for s, e in [(0, 3), (3, 8), (8, 9), (9, 13)]]
            assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5, rtol=0)
        # without a cache every call is its own sequence: the second segment alone differs from its place in `full`
        alone = model(ids[:, 8:], use_cache=False).logits
    assert not torch.allclose(alone, full[:, 8:], atol=1e-3)


@pytest.mark.parametrize("family", ["gpt2", "falcon"])  # other layer layouts: transformer.h; falcon returns a tuple
def test_other_decoders_same_contract(family):
    model = tiny_model(family).eval()
    ids = _ids(n=7)
    with torch.no_grad():
        ref = model(ids).logits
        memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[0], **CFG))
        assert torch.equal(model(ids).logits, ref)
    _activate(model)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kw), _greedy_loop(model, ids, 6))


def test_beam_search_moves_the_memory_with_the_cache():
    model = _activate(_patched(layers=(0, 1)))
    ids = _ids(n=5)
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


def test_static_and_reused_caches():
    model = _activate(_patched(layers=(0, 1)))
    ids = _ids(n=6)
    kw = dict(max_new_tokens=7, do_sample=False, pad_token_id=0)
    ref = _greedy_loop(model, ids, 7)
    for _ in range(2):  # transformers keeps one StaticCache and reset()s it between calls
        assert torch.equal(model.generate(ids, cache_implementation="static", **kw), ref)
    cache = DynamicCache(config=model.config)
    assert torch.equal(model.generate(ids, **_cache(model, cache), **kw), ref)
    cache.reset()
    assert torch.equal(model.generate(ids, **_cache(model, cache), **kw), ref)


def test_deepcopy_gives_an_independent_patched_model():  # e.g. TRL's reference model
    model = _activate(_patched())
    ids = _ids()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(twin(ids).logits, ref)
        titans_branches(twin)[1].out.weight.mul_(2)  # the copy's forward uses the copy's memory
        assert not torch.allclose(twin(ids).logits, ref, atol=1e-4)
        assert torch.equal(model(ids).logits, ref)
    memgrad_hf.unpatch_model(twin)
    assert is_titans_patched(model) and not is_titans_patched(twin)


@pytest.mark.parametrize("head", [False, True])
def test_a_pickled_model_keeps_its_memory(head):
    # torch.save(model) / multiprocessing pickle the model: the mask hooks were closures (torch.save raised) and a
    # bound layer forward is pickled by a name the layer's class lacks; the memory must run after loading
    import io

    model = _activate(_patched(layers=(0, 1), head=head))
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    twin = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, ref)
        # the mask hooks run too: a chunk of left padding (positions given) is kept out of the memory
        padded = torch.cat([torch.zeros(2, 4, dtype=ids.dtype), ids], 1)
        mask = (torch.arange(padded.shape[1]) >= 4).long().expand(2, -1)
        pos = (torch.arange(padded.shape[1]) - 4).clamp(min=0).expand(2, -1)
        assert torch.allclose(twin(padded, attention_mask=mask, position_ids=pos).logits[:, 4:], ref, atol=1e-5)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(twin.generate(ids, **kw), model.generate(ids, **kw))
    memgrad_hf.unpatch_model(twin)
    assert not is_titans_patched(twin)
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, tiny_model("llama").eval()(ids).logits)


def test_a_dropped_cache_is_freed_at_once():
    # the memory's methods on a cache were bound methods, a cycle: each dropped cache (its K/V and their graph) lived
    # until the cycle collector ran (10 of 40 training steps' caches alive in a user's loop)
    import gc
    import weakref

    model = _activate(_patched()).train()
    ids = _ids()
    gc.collect()
    gc.disable()
    try:
        out = model(ids, labels=ids, use_cache=True)
        cache = weakref.ref(out.past_key_values)
        assert "reorder_cache" in vars(out.past_key_values)  # the memory's methods are installed
        out.loss.backward()
        del out
        assert cache() is None
    finally:
        gc.enable()
    with torch.no_grad():  # a deep copy moves the memory with it
        cached = model.eval()(ids[:, :6], use_cache=True).past_key_values
    cached.reorder_cache(torch.tensor([1, 0]))
    twin = copy.deepcopy(cached)
    twin.reorder_cache(torch.tensor([1, 0]))
    mine, theirs = (next(iter(c.__dict__["_memgrad_titans_states"].values())).state for c in (cached, twin))
    assert not torch.equal(mine.pending[0], theirs.pending[0])  # the copy's call moved the copy's state only


def test_cache_misuse_is_an_error():
    model = _activate(_patched())
    ids = _ids(n=6)
    plain = tiny_model("llama").eval()
    with torch.no_grad():
        cache = DynamicCache(config=plain.config)
        plain(ids, **_cache(plain, cache), use_cache=True)  # filled without memory
        with pytest.raises(ValueError, match="no memory state"):
            model(ids[:, :1], **_cache(model, cache), use_cache=True)
        cache = DynamicCache(config=model.config)
        model(ids, **_cache(model, cache), use_cache=True)
        with pytest.raises(NotImplementedError, match="rolled back"):
            cache.crop(-2)
        cache.crop(0)  # a no-op stays allowed


def test_several_streams_through_a_layer_are_refused_when_cached():
    # ProphetNet's decoder runs its main stream and its n-gram streams through each layer as one sequence: the memory
    # trains and runs uncached, but it cannot follow a cache that counts one position per token (refused by name;
    # it was a ValueError about an edited cache)
    from benchmarks.compat import _tiny
    from benchmarks.compat_titans import _incremental_logits

    model = _activate(memgrad_hf.patch_model(_tiny("prophetnet").eval(), head=False,
                                             titans=TitansConfig(layers=[-1], **CFG)))
    ids = torch.randint(3, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, use_cache=False).logits).all()
        with pytest.raises(UnsupportedModelError, match=r"3 per token .*ProphetNet's n-gram decoder"):
            _incremental_logits(model, ids, 5)


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_training_with_head_patch_step0_then_all_memory_params_learn():
    model = tiny_model("llama").train()
    ids = _ids(n=12)
    ref = _hf_loss(model, ids).item()
    memgrad_hf.patch_model(model, titans=TitansConfig(layers=[1], **CFG))  # head=True (default) as well
    assert is_head_patched(model)
    loss = _hf_loss(model, ids)
    assert loss.item() == pytest.approx(ref, rel=1e-6)
    loss.backward()
    branch = titans_branches(model)[1]
    assert branch.out.weight.grad.abs().sum() > 0
    for name, p in branch.named_parameters():  # at W_o = 0 only W_o itself receives gradient
        if name != "out.weight":
            assert p.grad is None or torch.count_nonzero(p.grad) == 0, name
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    opt.zero_grad()
    _hf_loss(model, ids).backward()
    for name, p in branch.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def _grads(model, ids):
    model.zero_grad()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_same_grads_and_memory_recomputed(reentrant):
    model = _activate(_patched(layers=(0, 1))).train()
    ids = _ids(n=10)
    calls = []
    # a pre-hook: non-reentrant recomputation stops early, once the saved tensors it needs exist again
    titans_branches(model)[0].register_forward_pre_hook(lambda *a: calls.append(1))
    ref = _grads(model, ids)
    assert len(calls) == 1
    enable_checkpointing(model, use_reentrant=reentrant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _grads(model, ids)
    assert len(calls) == 3  # forward + recomputation in backward: the branch is inside the checkpoint
    assert ref.keys() == got.keys() and any("titans_memory.memory.memory_weights" in k for k in ref)
    for k in ref:
        assert torch.allclose(got[k], ref[k], atol=1e-6, rtol=1e-5), k


def test_peft_lora_with_memory_in_modules_to_save():
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama").train()
    ids = _ids(n=8)
    ref = _hf_loss(model, ids).item()
    memgrad_hf.patch_model(model, titans=TitansConfig(layers=[1], **CFG))
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["titans_memory"])
    peft = get_peft_model(model, lora)
    loss = _hf_loss(peft, ids)
    assert loss.item() == pytest.approx(ref, rel=1e-6)
    loss.backward()
    trained = [p for n, p in peft.named_parameters() if n.endswith("titans_memory.modules_to_save.default.out.weight")]
    assert len(trained) == 1 and trained[0].grad.abs().sum() > 0


def test_load_titans_of_a_peft_modules_to_save_file_into_a_plain_model_names_the_merge(tmp_path):
    # the file holds PEFT's original and trained copies of each memory: the error said to re-patch instead
    from peft import LoraConfig, get_peft_model

    model = memgrad_hf.patch_model(tiny_model("llama"), titans=TitansConfig(layers=[1], **CFG))
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["titans_memory"]))
    save_titans(peft, tmp_path)
    plain = memgrad_hf.patch_model(tiny_model("llama"), titans=TitansConfig(layers=[1], **CFG))
    with pytest.raises(ValueError, match=r"PEFT model with modules_to_save.*merge_and_unload"):
        load_titans(plain, tmp_path)


def test_peft_freezing_the_untrained_memory_is_warned_about(caplog):
    # PEFT freezes a memory left out of modules_to_save: still zero, its branch added nothing, silently
    from peft import LoraConfig, get_peft_model

    model = memgrad_hf.patch_model(tiny_model("llama").train(), titans=TitansConfig(layers=[0, 1], **CFG))
    frozen = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        _hf_loss(frozen, _ids(n=8)).backward()
    assert "adds nothing" in caplog.text and "modules_to_save=['titans_memory']" in caplog.text
    assert caplog.text.count("adds nothing") == 1  # one line per model, not one per memory layer
    caplog.clear()
    model = memgrad_hf.patch_model(tiny_model("llama").train(), titans=TitansConfig(layers=[1], **CFG))
    kept = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["titans_memory"]))
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        _hf_loss(kept, _ids(n=8)).backward()
        # a reference pass with gradients on (a KL term): PEFT runs its frozen original copy, as it should
        with kept.disable_adapter():
            _hf_loss(kept, _ids(n=8))
    assert "adds nothing" not in caplog.text


def test_memory_added_to_a_peft_model_warns_that_peft_will_not_save_it(caplog):
    # (the memory trained, then PEFT's save and every Trainer checkpoint left it out: resumed runs restarted it)
    import logging

    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"]))
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.patches"):
        memgrad_hf.patch_model(peft, titans=TitansConfig(layers=[1], **CFG))
    assert "modules_to_save=['titans_memory']" in caplog.text and "save_titans" in caplog.text


def test_a_trainer_warns_about_a_titans_checkpoint_loaded_without_its_memory(tmp_path, caplog):
    # TRL's trainers load model="path" with a plain from_pretrained: the memory was dropped without a word, and the
    # saved result then failed to load with memgrad_hf.titans.from_pretrained
    from transformers import Trainer, TrainingArguments

    model = memgrad_hf.patch_model(tiny_model("llama"), head=False, titans=TitansConfig(layers=[-1], **CFG))
    model.save_pretrained(tmp_path)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        Trainer(model=from_pretrained(tmp_path), args=args)
        assert "loaded without it" not in caplog.text
        Trainer(model=AutoModelForCausalLM.from_pretrained(tmp_path), args=args)
    assert "saved with Titans memory (config.memgrad_titans) but is loaded without it" in caplog.text
    assert "memgrad_hf.titans.from_pretrained(path)" in caplog.text


def test_save_pretrained_round_trip_and_plain_transformers_load(tmp_path):
    model = tiny_model("llama").eval()
    ids = _ids()
    keys = list(model.state_dict())
    with torch.no_grad():
        original = model(ids).logits
    memgrad_hf.patch_model(model, titans=TitansConfig(layers=[-1], **CFG))
    _activate(model)
    with torch.no_grad():
        patched = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["memgrad_titans"]
    assert saved == TitansConfig(layers=[1], **CFG).to_dict()

    cls = type(model)
    before = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
    loaded = from_pretrained(tmp_path).eval()
    assert cls.__dict__.get("_keys_to_ignore_on_load_unexpected") == before  # no lasting change to the class
    assert is_titans_patched(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, patched)
    for k, v in titans_state_dict(model).items():
        assert torch.equal(titans_state_dict(loaded)[k], v)

    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # memory keys reported unexpected, not loaded
    assert not is_titans_patched(plain) and list(plain.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, original)
    load_titans(plain, tmp_path)  # the memory onto an already-loaded model
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, patched)

    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path / "sharded")(ids).logits, patched)


def test_from_pretrained_loads_a_seq2seq_model_as_the_class_it_was_saved_from(tmp_path):
    # patch_model takes encoder-decoders; loading them as AutoModelForCausalLM (the old default) raised
    # transformers' "Unrecognized configuration class" naming no fix
    from transformers import BartForConditionalGeneration

    torch.manual_seed(0)
    seq2seq = BartForConditionalGeneration(tiny_model("bart").config).eval()
    model = memgrad_hf.patch_model(seq2seq, head=False, titans=TitansConfig(layers=[-1], **CFG))
    _activate(model)
    ids = _ids()
    with torch.no_grad():
        patched = model(input_ids=ids, decoder_input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model) and is_titans_patched(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, decoder_input_ids=ids).logits, patched)


def test_patch_model_without_head_or_memory_warns_that_it_changes_nothing(caplog):
    # both were silent no-ops: head=False alone, and head settings passed with head=False
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        memgrad_hf.patch_model(tiny_model("llama"), head=False)
    assert "changes nothing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        model = memgrad_hf.patch_model(tiny_model("llama"), head=False, titans=TitansConfig(layers=[0], **CFG),
                                       chunk_size=64)
    assert "chunk_size" in caplog.text and "ignored" in caplog.text and is_titans_patched(model)


def test_save_titans_separately_and_mismatch_errors(tmp_path):
    model = _activate(_patched(layers=(0,)))
    ids = _ids()
    with torch.no_grad():
        patched = model(ids).logits
    path = save_titans(model, tmp_path)
    assert path.endswith("memgrad_titans.safetensors")
    fresh = tiny_model("llama").eval()  # same base weights, config without memgrad_titans: config from metadata
    load_titans(fresh, tmp_path)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, patched)
    other = _patched(layers=(1,))
    with pytest.raises(ValueError, match="does not match.*Patch the model with the checkpoint's TitansConfig"):
        load_titans(other, tmp_path)
    # a checkpoint with FANs into memories without: the FAN fix is named (a bare key list before)
    save_titans(_patched(layers=(0,), fan=True), tmp_path / "fan")
    with pytest.raises(ValueError, match=r"holds FANs .* TitansConfig\(\.\.\., fan=True\)"):
        load_titans(_patched(layers=(0,)), tmp_path / "fan")
    with pytest.raises(ValueError, match="no Titans memory"):
        save_titans(tiny_model("llama"), tmp_path)
    tiny_model("llama").save_pretrained(tmp_path / "bare")  # a checkpoint without memory
    with pytest.raises(ValueError, match="no Titans config"):
        load_titans(tiny_model("llama"), tmp_path / "bare")


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="out of range"):
        memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[2]))
    with pytest.raises(ValueError, match="named twice"):
        memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[1, -1]))
    with pytest.raises(ValueError, match="empty"):
        memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[]))
    with pytest.raises(ValueError, match="divisible"):  # a bad memory setting leaves the model untouched
        memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[0], heads=5))
    assert not is_titans_patched(model) and not any("titans" in k for k in model.state_dict())
    with pytest.raises(ValueError, match="chunk_size"):  # the head patch fails after injection: rolled back
        memgrad_hf.patch_model(model, titans=TitansConfig(layers=[0], **CFG), chunk_size=-1)
    assert not is_titans_patched(model) and not is_head_patched(model)
    with pytest.raises(ValueError, match="True is not an integer layer index"):
        memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[True]))
    # integer-likes as users hold them (np.arange, a tensor: tensor([0]) is falsy, yet not empty) are indices
    import numpy as np
    for layers in (np.arange(1), torch.tensor([0]), [np.int64(-2)]):
        twin = tiny_model("llama")
        memgrad_hf.patch_model(twin, head=False, titans=TitansConfig(layers=layers, **CFG))
        assert twin.config.memgrad_titans["layers"] == [0] and type(twin.config.memgrad_titans["layers"][0]) is int
    memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[-2], **CFG))
    assert model.config.memgrad_titans["layers"] == [0]
    with pytest.raises(ValueError, match="already has Titans"):
        memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[1]))
    remove_titans(model)
    remove_titans(model)  # idempotent


    class NoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)

    with pytest.raises(UnsupportedModelError, match="NoLayers"):
        memgrad_hf.patch_model(NoLayers(), head=False, titans=TitansConfig())


def _left_pad(seqs, pad=0):
    n = max(len(s) for s in seqs)
    ids = torch.tensor([[pad] * (n - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_left_padded_batched_generate_equals_each_prompt_alone(family):
    # padding of a whole chunk (4 tokens) keeps the chunk grid: each row must equal its prompt generated alone
    model = _activate(_patched(family, layers=(0, 1)))
    short, long = _ids(1, 3, seed=5)[0].tolist(), _ids(1, 7, seed=6)[0].tolist()
    ids, mask = _left_pad([short, long])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, **kw)
    for row, prompt in zip(batched, (short, long), strict=True):
        alone = model.generate(torch.tensor([prompt]), **kw)[0]
        assert row[-8:].tolist() == alone[-8:].tolist()
    # cached == uncached with padding too
    assert torch.equal(batched, model.generate(ids, attention_mask=mask, use_cache=False, **kw))


def test_static_cache_decoding_past_a_sliding_window_is_exact_and_says_nothing(caplog):
    # past the window, a decode step's 4-D mask no longer reaches the token's own cache column; the token is a
    # generated one (never padding), so the memory stores it as it must, but every step warned that padding could
    # not be read (6 warnings for 8 tokens)
    import logging

    model = _activate(memgrad_hf.patch_model(tiny_model("mistral", sliding_window=6).eval(), head=False,
                                             titans=TitansConfig(layers=[0, 1], **CFG)))
    ids = _ids(1, 5, seed=3)
    with caplog.at_level(logging.WARNING, logger="memgrad_hf"):
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(out, _greedy_loop(model, ids, 8))
    assert "does not cover" not in caplog.text


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: generate hands a dict of masks by layer type
def test_left_padded_generate_with_a_static_cache_equals_each_prompt_alone(family):
    # a static cache makes generate pass a 4-D mask: padding is read from it (was stored: rows differed)
    model = _activate(_patched(family, layers=(0, 1)))
    short, long = _ids(1, 3, seed=5)[0].tolist(), _ids(1, 7, seed=6)[0].tolist()
    ids, mask = _left_pad([short, long])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, cache_implementation="static", **kw)
    for row, prompt in zip(batched, (short, long), strict=True):
        assert row[-8:].tolist() == model.generate(torch.tensor([prompt]), **kw)[0][-8:].tolist()


def _block_causal(lengths, additive=False):
    """A 4-D mask (1, 1, T, T) of documents packed in one row, each attending causally to itself only."""
    t = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ok = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    ok = ok[None, None]
    return torch.zeros(ok.shape).masked_fill(~ok, torch.finfo(torch.float32).min) if additive else ok


@pytest.mark.parametrize("additive", [False, True])
def test_4d_masks_keep_padding_out_and_restart_the_memory_per_document(additive):
    model = _activate(_patched("llama", layers=(0, 1)))
    docs = [_ids(1, n, seed=s)[0] for n, s in ((5, 11), (6, 12))]
    with torch.no_grad():
        out = model(torch.cat(docs)[None], attention_mask=_block_causal([5, 6], additive), use_cache=False).logits
        s = 0
        for d in docs:
            assert torch.allclose(out[0, s:s + len(d)], model(d[None], use_cache=False).logits[0], atol=1e-5, rtol=0)
            s += len(d)
        # left padding in a 4-D mask: the pads' content never reaches a real token
        ids, mask = _left_pad([_ids(1, 4, seed=7)[0].tolist(), _ids(1, 9, seed=8)[0].tolist()])
        keys = mask[:, None, None, :].bool() & torch.ones(9, 9, dtype=torch.bool).tril()
        four_d = torch.zeros(keys.shape).masked_fill(~keys, torch.finfo(torch.float32).min) if additive else keys
        other = ids.clone()
        other[mask == 0] = 17
        a, b = (model(x, attention_mask=four_d, use_cache=False).logits for x in (ids, other))
        assert torch.allclose(a[mask == 1], b[mask == 1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("additive", [False, True])
def test_4d_masks_restart_the_memory_per_document_in_a_batch_with_padding(additive):
    # a packing collator pads rows to one length: one padded row used to switch the document restarts off for the
    # whole batch (the memory then ran on from one document into the next)
    model = _activate(_patched("llama", layers=(0, 1)))
    rows = [(9, 7), (5, 6)]  # the second row ends in 5 pads
    docs = [_ids(1, n, seed=20 + i)[0] for i, n in enumerate(sum(rows, ()))]
    t = sum(rows[0])
    ids = torch.zeros(2, t, dtype=torch.long)
    keys = torch.zeros(2, 1, t, t, dtype=torch.bool)
    k = 0
    for r, lengths in enumerate(rows):
        n = sum(lengths)
        ids[r, :n] = torch.cat(docs[k:k + len(lengths)])
        keys[r, :, :n, :n] = _block_causal(lengths)[0]
        k += len(lengths)
    four_d = torch.zeros(keys.shape).masked_fill(~keys, torch.finfo(torch.float32).min) if additive else keys
    with torch.no_grad():
        out = model(ids, attention_mask=four_d, use_cache=False).logits
        k = 0
        for r, lengths in enumerate(rows):
            s = 0
            for n in lengths:
                alone = model(docs[k][None], use_cache=False).logits[0]
                assert torch.allclose(out[r, s:s + n], alone, atol=1e-5, rtol=0), (r, n)
                s, k = s + n, k + 1


def test_padding_content_never_reaches_the_memory():
    # padding not a multiple of the chunk size: the pads' token ids must still not change any real token's logits
    model = _activate(_patched("llama", layers=(0, 1)))
    ids, mask = _left_pad([_ids(1, 4, seed=7)[0].tolist(), _ids(1, 9, seed=8)[0].tolist()])
    other = ids.clone()
    other[mask == 0] = 17
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = model(other, attention_mask=mask).logits
        assert torch.allclose(a[mask == 1], b[mask == 1], atol=1e-6, rtol=0)
        twin = copy.deepcopy(model)  # a copy's hooks feed the copy's memory
        assert torch.allclose(twin(other, attention_mask=mask).logits[mask == 1], a[mask == 1], atol=1e-6, rtol=0)
        # the memory reads the mask through a hook on the backbone; once unpatched, nothing is left behind
        memgrad_hf.unpatch_model(model)
        for m in (model, model.model):
            assert not m._forward_pre_hooks and not m._forward_hooks
        assert not any(k.startswith("_memgrad") for k in model.model.__dict__)


def test_a_call_to_the_backbone_alone_keeps_padding_out_and_restarts_per_document():
    # value and reward heads, embedding extractors call the backbone (model.model) directly: stock attention
    # separates padding and packed documents there too, so the memory must
    model = _activate(_patched("llama", layers=(0, 1)))
    ids, mask = _left_pad([_ids(1, 4, seed=7)[0].tolist(), _ids(1, 9, seed=8)[0].tolist()])
    other = ids.clone()
    other[mask == 0] = 17
    docs = [_ids(1, n, seed=s)[0] for n, s in ((5, 11), (7, 12))]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        a, b = (model.model(x, attention_mask=mask).last_hidden_state for x in (ids, other))
        assert torch.allclose(a[mask == 1], b[mask == 1], atol=1e-6, rtol=0)
        full = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        assert torch.allclose(full[mask == 1], a[mask == 1], atol=1e-6, rtol=0)
        packed = model.model(torch.cat(docs)[None], position_ids=pos, use_cache=False).last_hidden_state
        alone = [model.model(d[None], use_cache=False).last_hidden_state[0] for d in docs]
        assert torch.allclose(packed[0], torch.cat(alone), atol=1e-5, rtol=0)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_documents_each_start_from_a_fresh_memory(checkpointing):
    # padding-free packing (TRL): position_ids restart per document, no attention mask, no cache; transformers
    # separates the documents in attention, the memory must reset at the same places
    model = _activate(_patched("llama", layers=(0, 1)))
    docs = [_ids(1, n, seed=s)[0] for n, s in ((5, 11), (7, 12), (3, 13))]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    if checkpointing:
        model.train()
        enable_checkpointing(model)
    out = model(ids, position_ids=pos, use_cache=False).logits
    out.sum().backward()  # the gather / scatter of documents is differentiable
    assert all(p.grad is not None for p in titans_branches(model)[0].memory.to_keys.parameters())
    with torch.no_grad():
        s = 0
        for d in docs:
            alone = model(d[None], use_cache=False).logits
            assert torch.allclose(out[0, s:s + len(d)], alone[0], atol=1e-5, rtol=0)
            s += len(d)
        # one document per row (no restart) takes the ordinary path and equals it
        assert torch.allclose(model(docs[1][None], position_ids=torch.arange(7)[None], use_cache=False).logits,
                              model(docs[1][None], use_cache=False).logits, atol=1e-6, rtol=0)


def test_packed_documents_over_several_rows_equal_each_document_alone():
    from memgrad_hf.patches.titans_masks import document_starts as _document_starts
    from memgrad_hf.titans import GatedMemoryBranch
    from memgrad_hf.titans.branch import run_packed_documents

    torch.manual_seed(0)
    branch = GatedMemoryBranch(16, heads=2, chunk_size=4, max_lr=0.5).double()
    torch.nn.init.normal_(branch.out.weight)
    lengths = [[6, 3, 5], [2, 9, 3]]  # two rows of 14 tokens, three documents each
    pos = torch.tensor([[i for n in row for i in range(n)] for row in lengths])
    x = torch.randn(2, 14, 16, dtype=torch.float64)
    out = run_packed_documents(branch, x, _document_starts(pos))
    for r, row in enumerate(lengths):
        s = 0
        for n in row:
            torch.testing.assert_close(out[r, s:s + n], branch(x[r:r + 1, s:s + n])[0][0], rtol=1e-10, atol=1e-12)
            s += n
    assert _document_starts(torch.arange(14)[None]) is None  # one document per row: the ordinary path


@pytest.mark.parametrize("family", ["mamba", "rwkv"])
def test_models_whose_cache_counts_no_tokens_train_and_generate_uncached(family):
    # their cache (a state-space DynamicCache; rwkv's own state) cannot carry the memory state: a cached call says
    # so and names use_cache=False (was a bare transformers ValueError or a generic message); uncached works
    from transformers import MambaConfig, RwkvConfig

    cfg = (MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4) if family == "mamba" else
           RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                      intermediate_size=64, context_length=64))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = _ids(n=9)
    ref = model(ids, labels=ids, use_cache=False).loss
    memgrad_hf.patch_model(model, titans=TitansConfig(layers=[-1], **CFG))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=0)  # step 0: the original model
    assert titans_branches(model)[1].out.weight.grad.abs().sum() > 0  # the memory learns
    _activate(model.eval())
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=False, **kw), _greedy_loop(model, ids, 3))
    with pytest.raises(UnsupportedModelError, match="use_cache=False"):
        model.generate(ids, **kw)


def test_a_bf16_model_with_an_fp32_residual_stream_trains_with_the_memory():
    # mamba keeps its residual stream in fp32 (residual_in_fp32) in a bf16 model: the memory's bf16 projections got
    # fp32 input ("expected m1 and m2 to have the same dtype"); found by a bf16 sweep (also falcon_mamba, mamba2, zaya)
    from transformers import MambaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                         state_size=4, residual_in_fp32=True)).to(torch.bfloat16)
    ids = _ids(n=9)
    ref = model(ids, labels=ids, use_cache=False).loss
    memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[-1], **CFG))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert torch.equal(out.loss, ref)  # step 0: the original model, bit for bit
    branch = titans_branches(model)[1]
    assert branch.out.weight.dtype == torch.bfloat16 and branch.out.weight.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in branch.parameters() if p.grad is not None)


def test_left_padded_training_batches_are_warned_about_once(caplog):
    import logging

    model = _patched("llama", layers=(0,)).train()
    ids, mask = _left_pad([_ids(1, 5, seed=7)[0].tolist(), _ids(1, 9, seed=8)[0].tolist()])
    with caplog.at_level(logging.WARNING, logger="memgrad_hf.patches.titans_masks"):
        for _ in range(2):
            model(ids, attention_mask=mask, use_cache=False)
        model.eval()
        with torch.no_grad():
            model(ids, attention_mask=mask, use_cache=False)
    assert caplog.text.count("left-padded") == 1 and "padding_side = 'right'" in caplog.text


@pytest.mark.parametrize("family", ["nemotron_h", "longcat_flash", "minimax"])
def test_hybrid_decoders_generate_with_the_memory_on_their_cache(family):
    # the memory finds the cache's token count where its layer keeps none: nemotron_h's MLP-only layer (a DummyLayer
    # of the cache), minimax's lightning-attention layer (no cache layer at all: get_seq_length said 0, and each
    # decoding step restarted the memory), longcat_flash's two attention modules per decoder layer (it read the
    # earlier layer's, already written in this forward). Each: step-0 identity, memory gradients, cached == uncached
    from benchmarks.compat_titans import check_titans

    assert check_titans(family)[0] == "exact"


@pytest.mark.parametrize("family, status, says", [
    ("xlstm", "exact, uncached", "recurrent state of the model's own"),  # its blocks get `state`, not a Cache
    ("deepseek_v4", "unsupported", "hidden states have shape (2, 10, 4, 32)"),  # several residual streams
])
def test_decoders_the_memory_cannot_follow_are_refused_by_name(family, status, says):
    from benchmarks.compat_titans import check_titans

    got, detail = check_titans(family)
    assert (got, says in detail) == (status, True), detail
