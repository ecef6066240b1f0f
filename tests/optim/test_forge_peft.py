"""LoRA A/B (PEFT) are plain nn.Linear layers: FORGE updates them inside their backward, equal to torch AdamW."""

import copy

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

from memgrad_hf.optim import ForgeAdamW
from tests.tiny_models import tiny_model

# the Trainer's activation checkpointing, under the name of the installed transformers (gradient_checkpointing is a
# deprecated alias since 5.24, gone in v6)
_NEW_NAME = "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
_CHECKPOINTING = {"activation_checkpointing" if _NEW_NAME else "gradient_checkpointing": True}


def _lora(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0, init_lora_weights="gaussian"))
    return model


def test_forge_on_lora_equals_torch_adamw():
    a = _lora(0)
    b = copy.deepcopy(a)
    ids = torch.randint(1, 100, (2, 12))
    opt_a = ForgeAdamW([p for p in a.parameters() if p.requires_grad], model=a, lr=1e-2, weight_decay=0.01)
    opt_b = torch.optim.AdamW([p for p in b.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    swapped = {type(m).__name__ for m in opt_a._swapped}
    assert swapped == {"Linear"} and len(opt_a._swapped) == 2 * 2 * 2  # A and B of q,v in 2 layers
    for _ in range(3):
        a(input_ids=ids, labels=ids).loss.backward()
        opt_a.step()
        b(input_ids=ids, labels=ids).loss.backward()
        opt_b.step()
        opt_b.zero_grad()
    assert all(p.grad is None for p in a.parameters())  # no gradient is left behind
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if p.requires_grad:
            assert "lora_" in n
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), n
        else:
            assert torch.equal(p, q), n  # the frozen base stays frozen


# head_grad auto: the tiny head's gradient is held; clip_pass auto: a second backward under checkpointing
@pytest.mark.parametrize("head_grad,clip_pass", [("auto", "auto"), ("recompute", "auto"), ("recompute", "replay")])
def test_everything_at_once_in_trainer_equals_stock(tmp_path, head_grad, clip_pass):
    # PEFT LoRA with a trained lm_head copy (modules_to_save) + patch_model + forge_adamw, with gradient accumulation,
    # gradient checkpointing, label smoothing, exact clipping, weight decay and a schedule: the same losses, grad
    # norms and weights as the stock model with adamw_torch.
    from transformers import Trainer, TrainingArguments

    import memgrad_hf
    from tests.test_trainer_integration import _data

    runs = []
    for patched in (True, False):
        torch.manual_seed(0)
        model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                               modules_to_save=["lm_head"], lora_dropout=0.0))
        if patched:
            memgrad_hf.patch_model(model, chunk_size=4)
        args = TrainingArguments(
            output_dir=str(tmp_path / str(patched)), max_steps=3, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to="none",
            use_cpu=True, seed=0, data_seed=0, optim="forge_adamw" if patched else "adamw_torch",
            optim_args=f"head_grad={head_grad},clip_pass={clip_pass}" if patched else None,
            lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.1, max_grad_norm=1.0,
            label_smoothing_factor=0.1, **_CHECKPOINTING)
        trainer = Trainer(model=model, args=args, train_dataset=_data(n=24))
        trainer.train()
        logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
        runs.append((model, logs))
    (got, got_logs), (ref, ref_logs) = runs
    assert len(got_logs) == 3
    for a, b in zip(got_logs, ref_logs, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    head = [n for n, _ in got.named_parameters() if "modules_to_save" in n]
    assert head, "the lm_head copy is trained"
    for (n, p), q in zip(got.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), n


@pytest.mark.parametrize("method", ["adalora", "adamss_asa", "adamss", "lora"])
def test_peft_methods_that_read_grad_after_backward_are_warned_about(method, caplog):
    # AdaLoRA's update_and_allocate multiplied by p.grad (None under FORGE: a bare TypeError in PEFT); ADAMSS's ASA
    # callback skipped every parameter without .grad (its allocation silently off)
    import types

    from peft import AdaLoraConfig

    if method == "adalora":
        model = get_peft_model(tiny_model("llama"),
                               AdaLoraConfig(target_modules=["q_proj", "v_proj"], total_step=10, init_r=4))
    elif method == "lora":
        model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    else:  # (building AdamssConfig's model needs scikit-learn: its config as PEFT records it)
        model = tiny_model("llama")
        model.peft_config = {"default": types.SimpleNamespace(peft_type="ADAMSS", use_asa=method == "adamss_asa")}
    with caplog.at_level("WARNING", logger="memgrad_hf"):
        ForgeAdamW(model.parameters(), model=model, lr=1e-3).detach()
    warned = [r.getMessage() for r in caplog.records if "leaves no .grad" in r.getMessage()]
    assert len(warned) == (method in ("adalora", "adamss_asa")) and all("adamw_torch" in m for m in warned)
