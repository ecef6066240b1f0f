"""A GRPO training step through memgrad's fused head, with the optimizer (``memgrad-hf bench grpo_step``).

TRL's trainers (GRPO, SFT, DPO, KTO, RLOO) score the policy through the fused head (``fused_lm_head=True``); with an
optimizer the head weight's gradient — ``vocab x hidden``, the largest of a small model's — is what remains. Each
peer runs the same steps (log-probs and entropies of ``completions x length`` tokens, the loss ``-(logp · adv).mean()
- 0.01 · entropy.mean()``, backward, update) on a Qwen2.5-0.5B-shaped head (hidden 896, vocab 151936) over
``--layers`` decoder layers:

- ``adamw_torch``: a ``patch_model``ed model, ``torch.optim.AdamW`` (every gradient whole);
- ``forge_adamw_whole_head``: memgrad's fused head on a model that was not ``patch_model``ed (``patch_trl()``
  alone), ``ForgeAdamW``: the head is updated from its whole gradient;
- ``forge_adamw``: a ``patch_model``ed model, ``ForgeAdamW``: the head's gradient goes to the optimizer in vocabulary
  blocks and never exists.

Peak memory added over the built model (optimizer state included) per configuration in a fresh process; time
round-robin.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.harness import Case, bench_parser, machine, peak_added_mib, print_peer_table, time_interleaved, versions

PEERS = ("adamw_torch", "forge_adamw_whole_head", "forge_adamw")


def setup(device: str, peer: str, layers: int, hidden: int, vocab: int, completions: int, length: int,
          dtype: str, steps: int, max_grad_norm: float) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import memgrad_hf
    from memgrad_hf.grpo import add_fused_lm_head
    from memgrad_hf.optim import ForgeAdamW

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=1, vocab_size=vocab,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=getattr(torch, dtype))
    if peer != "forge_adamw_whole_head":
        memgrad_hf.patch_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if peer == "adamw_torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    else:
        opt = ForgeAdamW(model.parameters(), model=model, lr=1e-5, max_grad_norm=max_grad_norm)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (completions, length), generator=g).to(device)
    return dict(model=model, opt=opt, ids=ids, steps=steps, peer=peer, max_grad_norm=max_grad_norm)


def run(s: dict) -> None:
    model, opt, ids = s["model"], s["opt"], s["ids"]
    for _ in range(s["steps"]):
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        adv = torch.linspace(-1, 1, out.log_probs.numel(), device=ids.device).reshape(out.log_probs.shape)
        loss = -(out.log_probs * adv).mean() - 0.01 * out.entropy.mean()
        if s["peer"] == "adamw_torch":
            loss.backward()
            if s["max_grad_norm"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s["max_grad_norm"])
        else:
            opt.backward(loss)  # (exact clipping's norm pass hooks in here, as at the Trainer's Accelerator.backward)
        opt.step()
        opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("grpo_step", __doc__, layers=1, hidden=896, vocab=151936)
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="steps per run (the first creates the optimizer state)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    torch.set_num_threads(a.threads)
    print(f"# GRPO step with the optimizer: {a.completions} x {a.length} tokens, {a.layers} layer(s), hidden "
          f"{a.hidden}, vocab {a.vocab}, {dtype}, max_grad_norm {a.max_grad_norm}, {a.steps} steps per run, "
          f"{a.device}\n# {machine(a.device)}; {versions()}\n")
    kw = dict(layers=a.layers, hidden=a.hidden, vocab=a.vocab, completions=a.completions, length=a.length,
              dtype=dtype, steps=a.steps, max_grad_norm=a.max_grad_norm)
    cases = [Case(peer, setup, run, dict(peer=peer, **kw)) for peer in a.peers]
    mem = {c.name: peak_added_mib(c, a.device, a.threads, in_process=a.device.startswith("cuda")) for c in cases}
    times = time_interleaved(cases, a.device, repeats=a.repeats, warmup=1)
    return 0 if print_peer_table(cases, mem, times, "adamw_torch", "adamw_torch", "s per run") else 1


if __name__ == "__main__":
    sys.exit(main())
