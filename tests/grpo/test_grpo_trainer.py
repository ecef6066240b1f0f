"""TRL trainers end to end on CPU (GRPO, RLOO, KTO, DPO, SFT): with memgrad's fused head (patch_trl) loss and grad norm
equal stock TRL's."""

import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

import memgrad_hf
from memgrad_hf.grpo import patch_trl, unpatch_trl
from memgrad_hf.offline import build_char_tokenizer
from tests.tiny_models import VOCAB, tiny_model


def _reward(completions, **_):
    return [c.count("a") - 0.01 * len(c) for c in completions]


def _model_and_tokenizer(tmp_path, from_path: bool):
    tok = build_char_tokenizer("abc def ghi jkl mno pqr stu vwx yz 0123456789 +-=?")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), max_position_embeddings=128, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    if from_path:  # TRL rebuilds a reference model from the model's path: give it one
        model.save_pretrained(tmp_path / "init")
        tok.save_pretrained(tmp_path / "init")
        model = LlamaForCausalLM.from_pretrained(tmp_path / "init")
    return model, tok


def _run(tmp_path, loss_type, patched, via_patch_model=False, beta=0.0, peft=False, trainer_cls=GRPOTrainer,
         **extra_args):
    model, tok = _model_and_tokenizer(tmp_path, from_path=beta > 0)
    data = Dataset.from_dict({"prompt": ["abc", "1+2=", "def", "9-3="] * 3})
    if trainer_cls is GRPOTrainer:
        extra_args["loss_type"] = loss_type
    config_cls = GRPOConfig if trainer_cls is GRPOTrainer else RLOOConfig
    args = config_cls(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=3, learning_rate=1e-3, logging_steps=1, report_to="none",
                      save_strategy="no", bf16=False, gradient_checkpointing=False, seed=0,
                      num_iterations=2, use_vllm=False, disable_tqdm=True, beta=beta, **extra_args)
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    import memgrad_hf.grpo.fused_head as fh

    calls = []
    real = fh.linear_logprobs
    fh.linear_logprobs = lambda *a, **k: calls.append(1) or real(*a, **k)
    if patched and via_patch_model:
        import memgrad_hf

        memgrad_hf.patch_model(model)
    elif patched:
        patch_trl()
    try:
        trainer = trainer_cls(model=model, args=args, reward_funcs=_reward, train_dataset=data,
                              processing_class=tok, peft_config=peft_config)
        trainer.train()
    finally:
        unpatch_trl()
        fh.linear_logprobs = real
    assert bool(calls) == patched  # memgrad's head served the policy passes exactly when patched
    hist = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in hist], [h["grad_norm"] for h in hist]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_grpo_loss_and_grad_norm_equal_stock_trl(tmp_path, loss_type):
    stock = _run(tmp_path / "s", loss_type, patched=False)
    ours = _run(tmp_path / "m", loss_type, patched=True)
    assert len(stock[0]) == 3
    assert ours[0] == pytest.approx(stock[0], rel=1e-5, abs=1e-7)
    assert ours[1] == pytest.approx(stock[1], rel=1e-5)


@pytest.mark.parametrize("kind", ["kto", "dpo"])
def test_preference_trainers_with_forge_adamw_equal_stock_adamw_torch(tmp_path, kind):
    # the loss is computed outside the model (policy and reference log-probs): FORGE's exact clipping (0.05: every
    # step clipped) must still see the whole backward, here under gradient checkpointing
    stock_log, stock_params = _preference_run(tmp_path / "s", False, kind, optim="adamw_torch")
    ours_log, ours_params = _preference_run(tmp_path / "m", False, kind, optim="forge_adamw")
    assert len(stock_log) == 3 and all(h["grad_norm"] > 0.05 for h in stock_log)
    for a, b in zip(stock_log, ours_log, strict=True):
        assert (b["loss"], b["grad_norm"]) == pytest.approx((a["loss"], a["grad_norm"]), rel=1e-5)
    err = max(((stock_params[n] - p).abs().max() / stock_params[n].abs().max()).item()
              for n, p in ours_params.items())
    assert err < 1e-5, err


@pytest.mark.parametrize("case", [dict(via_patch_model=True), dict(beta=0.04), dict(peft=True)],
                         ids=["automatic_via_patch_model", "reference_model_beta", "peft_lora"])
def test_grpo_variants_equal_stock_trl(tmp_path, case):
    stock = _run(tmp_path / "s", "dapo", patched=False, **{k: v for k, v in case.items() if k != "via_patch_model"})
    ours = _run(tmp_path / "m", "dapo", patched=True, **case)
    assert ours[0] == pytest.approx(stock[0], rel=1e-5, abs=1e-7)
    assert ours[1] == pytest.approx(stock[1], rel=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.05], ids=["no_reference", "reference_model"])
def test_rloo_trainer_equals_stock_trl(tmp_path, beta):
    # TRL's RLOOTrainer uses the same fused head: memgrad's must serve it just as exactly
    stock = _run(tmp_path / "s", None, patched=False, beta=beta, trainer_cls=RLOOTrainer)
    ours = _run(tmp_path / "m", None, patched=True, beta=beta, trainer_cls=RLOOTrainer)
    assert len(stock[0]) == 3 and max(stock[1]) > 0
    assert ours[0] == pytest.approx(stock[0], rel=1e-5, abs=1e-7)
    assert ours[1] == pytest.approx(stock[1], rel=1e-5)


def _preference_run(tmp_path, patched, kind, optim=None):
    """KTOTrainer (unpaired: completion + label) or DPOTrainer (chosen / rejected), 3 steps. With ``optim`` (the model
    ``patch_model``ed for a FORGE one): clipping active, checkpointing on; the log and the trained weights return."""
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    import memgrad_hf.grpo.fused_head as fh

    model, tok = _model_and_tokenizer(tmp_path, from_path=True)
    extra = {}
    if optim is not None:
        extra = dict(optim=optim, max_grad_norm=0.05, adam_epsilon=1e-3, gradient_checkpointing=True,
                     learning_rate=1e-2)
        if optim.startswith("forge"):
            memgrad_hf.patch_model(model)
    prompts = ["abc", "1+2=", "def", "9-3="] * 4
    if kind == "kto":
        data = Dataset.from_dict({"prompt": prompts, "completion": [" aaa", " 3", " bb", " 6"] * 4,
                                  "label": [True, True, False, True] * 4})
        config_cls, trainer_cls = KTOConfig, KTOTrainer
    else:
        data = Dataset.from_dict({"prompt": prompts, "chosen": [" aaa", " 3", " bb", " 6"] * 4,
                                  "rejected": [" zz", " 4", " yy", " 7"] * 4})
        config_cls, trainer_cls = DPOConfig, DPOTrainer
    args = config_cls(**{**dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, max_steps=3,
                                learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", bf16=False,
                                seed=0, disable_tqdm=True), **extra})
    calls = []
    real = fh.linear_logprobs
    fh.linear_logprobs = lambda *a, **k: calls.append(1) or real(*a, **k)
    if patched:
        patch_trl()
    try:
        trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tok)
        trainer.train()
    finally:
        unpatch_trl()
        fh.linear_logprobs = real
    assert bool(calls) == (patched or optim is not None and optim.startswith("forge"))
    hist = [h for h in trainer.state.log_history if "loss" in h]
    if optim is not None:
        return hist, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return [h["loss"] for h in hist], [h["grad_norm"] for h in hist]


@pytest.mark.parametrize("kind", ["kto", "dpo"])
def test_preference_trainers_equal_stock_trl(tmp_path, kind):
    # KTO (policy, reference and KL passes) and DPO (policy and reference) score through the fused head too
    stock = _preference_run(tmp_path / "s", False, kind)
    ours = _preference_run(tmp_path / "m", True, kind)
    assert len(stock[0]) == 3
    assert ours[0] == pytest.approx(stock[0], rel=1e-5)
    assert ours[1] == pytest.approx(stock[1], rel=1e-5)


def test_grpo_with_forge_adamw_equals_adamw_torch(tmp_path):
    import memgrad_hf  # noqa: F401  (registers forge_adamw)

    ref = _run(tmp_path / "a", "dapo", patched=True, optim="adamw_torch", max_grad_norm=0.0)
    ours = _run(tmp_path / "f", "dapo", patched=True, optim="forge_adamw", max_grad_norm=0.0)
    assert ours[0] == pytest.approx(ref[0], rel=1e-5, abs=1e-7)
    assert ours[1] == pytest.approx(ref[1], rel=1e-4)  # FORGE logs the real norm it measured in backward


@pytest.mark.parametrize("accumulation,via_patch_model", [(1, False), (2, False), (1, True), (2, True)],
                         ids=["one_micro_batch", "accumulation_2", "patch_model", "patch_model_accumulation_2"])
def test_grpo_with_forge_adamw_and_exact_clipping_equals_adamw_torch(tmp_path, accumulation, via_patch_model):
    # GRPO computes its loss outside the model: exact clipping's norm pass hooks in at Accelerator.backward. After
    # patch_trl() the LM head's gradient comes from the fused head through autograd (a fused weight used outside its
    # module); for a patch_model()ed model FORGE takes it in vocabulary blocks, as from the model's own loss
    import memgrad_hf  # noqa: F401  (registers forge_adamw)

    kw = dict(max_grad_norm=0.01, gradient_accumulation_steps=accumulation, via_patch_model=via_patch_model)
    ref = _run(tmp_path / "a", "dapo", patched=True, optim="adamw_torch", **kw)
    ours = _run(tmp_path / "f", "dapo", patched=True, optim="forge_adamw", **kw)
    assert max(ref[1]) > 0.01  # clipping was active
    assert ours[0] == pytest.approx(ref[0], rel=1e-5, abs=1e-7)
    assert ours[1] == pytest.approx(ref[1], rel=1e-4)



def test_compiled_grpo_with_forge_adamw_and_exact_clipping_equals_eager_adamw_torch(tmp_path, fresh_compile):
    """GRPOTrainer(torch_compile=True) on a patch_model()ed policy: the fused head's FORGE consumer is built in a
    compile-disabled call (as the patched model's own loss), and clipping with accumulation stays exact. aot_eager:
    inductor's graph capture and autograd partitioning without its code generation."""
    kw = dict(max_grad_norm=0.01, gradient_accumulation_steps=2, via_patch_model=True)
    ref = _run(tmp_path / "a", "dapo", patched=True, optim="adamw_torch", **kw)
    ours = _run(tmp_path / "f", "dapo", patched=True, optim="forge_adamw", torch_compile=True,
                torch_compile_backend="aot_eager", **kw)
    assert max(ref[1]) > 0.01  # clipping was active
    assert ours[0] == pytest.approx(ref[0], rel=1e-5, abs=1e-7)
    assert ours[1] == pytest.approx(ref[1], rel=1e-5)

def test_patch_trl_swaps_and_restores():
    import importlib
    import sys

    import trl.trainer.grpo_trainer as g

    before = g.add_fused_lm_head
    async_name = "trl.experimental.async_grpo.async_grpo_trainer"
    sys.modules.pop(async_name, None)
    assert "grpo_trainer" in patch_trl()
    assert g.add_fused_lm_head is not before
    # a trainer module imported afterwards (TRL's experimental ones import the function by name) routes too
    # (AsyncGRPOTrainer kept TRL's head: a patch_model()ed policy lost the chunked head and FORGE's head update)
    late = importlib.import_module(async_name)
    assert late.add_fused_lm_head is g.add_fused_lm_head
    unpatch_trl()
    assert g.add_fused_lm_head is before and late.add_fused_lm_head is before


def test_a_deep_copy_made_after_the_fused_head_scores_with_its_own_weights():
    # e.g. a reference or EMA model copied from a trainer's policy: the copy ran the original model's forward
    import copy

    from memgrad_hf.grpo import add_fused_lm_head

    model = memgrad_hf.patch_model(tiny_model("llama"))
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(3.0)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    a = model(input_ids=ids, labels=ids, fused_lm_head=True)
    b = twin(input_ids=ids, labels=ids, fused_lm_head=True)
    ref = torch.log_softmax(twin(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(b.log_probs, ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a.log_probs, b.log_probs)


def test_sft_trainer_through_memgrad_head_has_the_exact_gradient(tmp_path):
    # TRL's SFTTrainer trains through the fused head (log-probs, entropy, top-1). With patch_model it is memgrad's:
    # the gradient of the first training step equals full logits + cross-entropy on the same model and batch.
    import torch.nn.functional as F
    from trl import SFTConfig, SFTTrainer

    import memgrad_hf

    model, tok = _model_and_tokenizer(tmp_path, from_path=False)
    memgrad_hf.patch_model(model)
    data = Dataset.from_dict({"text": ["abc def ghi 123", "jkl mno 456 pqr", "stu vwx 789", "yz abc 0+1=1"] * 4})
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, max_steps=1,
                     report_to="none", seed=0, max_length=32, gradient_checkpointing=False, max_grad_norm=0.0,
                     disable_tqdm=True, logging_steps=1, bf16=False)  # SFTConfig defaults to bf16 autocast, even on CPU
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    seen = {}
    step = trainer.training_step

    def training_step(model_, inputs, num_items=None):
        batch = {k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)}
        out = step(model_, inputs, num_items)
        ours = {n: p.grad.clone() for n, p in model_.named_parameters()}
        model_.zero_grad()
        logits = model_(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], skip_logits=False).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100,
                        reduction="sum").div(num_items).backward()
        seen["err"] = max(((ours[n] - p.grad).abs().max() / p.grad.abs().max()).item()
                          for n, p in model_.named_parameters())
        return out

    trainer.training_step = training_step
    trainer.train()
    assert seen["err"] < 1e-5, seen
    assert "mean_token_accuracy" in trainer.state.log_history[0]  # the metrics came through the fused head too


@pytest.mark.parametrize("head", [True, False], ids=["chunked_head", "memory_only"])
def test_reference_model_of_a_titans_policy_gets_its_memory(tmp_path, head):
    # TRL loads the reference from the policy's path with a plain from_pretrained, which drops a Titans memory: it
    # gets the policy's (GRPO's KL is then exactly 0 at step 1, as for any policy equal to its reference), with or
    # without the chunked head (a memory-only policy runs TRL's own head; its reference lacked the memory)
    import memgrad_hf
    from memgrad_hf.patches.titans import is_titans_patched, titans_branches
    from memgrad_hf.titans import TitansConfig
    from memgrad_hf.titans import from_pretrained as titans_from_pretrained

    model, tok = _model_and_tokenizer(tmp_path, from_path=False)
    memgrad_hf.patch_model(model, head=False, titans=TitansConfig(layers=[-1], heads=2, chunk_size=4))
    with torch.no_grad():  # a trained memory: it changes the outputs
        for branch in titans_branches(model).values():
            branch.out.weight.copy_(torch.randn(branch.out.weight.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    model = titans_from_pretrained(tmp_path / "init")
    if head:
        memgrad_hf.patch_model(model)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=1, logging_steps=1, report_to="none", save_strategy="no",
                      bf16=False, use_vllm=False, disable_tqdm=True, beta=0.04, seed=0)
    trainer = GRPOTrainer(model=model, args=args, reward_funcs=_reward, train_dataset=Dataset.from_dict(
        {"prompt": ["abc", "1+2=", "def", "9-3="]}), processing_class=tok)
    assert is_titans_patched(trainer.ref_model)
    for a, b in zip(titans_branches(trainer.ref_model).values(), titans_branches(model).values(), strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    trainer.train()
    assert trainer.state.log_history[0]["kl"] == 0.0


def test_memory_report_under_grpo_counts_trls_tokens_without_a_warning_per_step(tmp_path):
    # GRPO batches are prompts (no input_ids): transformers, asked by the callback to count tokens, warned at every
    # step that it could not; TRL counts them itself, and tokens_per_s comes from its count.
    import logging

    from memgrad_hf.callbacks import MemoryReportCallback

    model, tok = _model_and_tokenizer(tmp_path, from_path=False)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=3, logging_steps=1, report_to="none", save_strategy="no",
                      bf16=False, use_vllm=False, disable_tqdm=True)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    trainer_logger = logging.getLogger("transformers.trainer")
    trainer_logger.addHandler(handler)
    report = MemoryReportCallback()
    try:
        trainer = GRPOTrainer(model=memgrad_hf.patch_model(model), args=args, reward_funcs=_reward,
                              processing_class=tok, train_dataset=Dataset.from_dict({"prompt": ["abc", "1+2="] * 4}),
                              callbacks=[report])
        trainer.train()
    finally:
        trainer_logger.removeHandler(handler)
    assert not [r for r in records if "number of tokens seen" in r.getMessage()]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and all(h["tokens_per_s"] > 0 for h in logged)
    assert report.summary["tokens_per_s"] > 0
    assert trainer_logger.filters == []  # the filter leaves with the run
