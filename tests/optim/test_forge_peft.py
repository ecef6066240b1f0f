"""LoRA A/B (PEFT) are plain nn.Linear layers: FORGE updates them inside their backward, equal to torch AdamW."""

import copy

import torch
from peft import LoraConfig, get_peft_model

from memgrad_hf.optim import ForgeAdamW
from tests.tiny_models import tiny_model


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
