"""Train a Titans-augmented language model with HF Trainer + memgrad_hf (neural memory + FAN distillation).

A Llama-style decoder gets a Titans neural-memory branch on chosen layers (``patch_model(model, titans=...)``): a
small MLP per head, trained inside the forward pass by an exact manual inner gradient. With ``--fan_distill_steps
N`` each memory also gets a FAN (Forward Alignment Network) that learns to predict that gradient from forward
features during the first N steps; then the memories switch to the FAN's prediction (no exact inner gradient after
that; the recipe prints the counter that proves it) and the run reports the cosine alignment reached.

Offline demo (no arguments): a tiny Llama built from a config, a character tokenizer built locally and generated
"recall stories" (facts stated early in a story are asked for later; held-out stories from another seed); 200 steps,
FAN distilled for the first 100; under a minute on a 2-core CPU. Prints progress, the final loss, bits per character
on held-out text (with the FAN gradient and, for comparison, with the exact gradient) and the FAN cosine.

Other data and models:

    python recipes/titans_lm.py --enwik8 /data/enwik8 --seq 512 --model_dim 256 --layers 4 --max_steps 5000 --bf16
    python recipes/titans_lm.py --text my_corpus.txt --layers 4 --memory_layers 1 3 --chunk_size 32
    python recipes/titans_lm.py --model Qwen/Qwen2.5-0.5B --text my_corpus.txt --memory_layers -1 --bf16

``--enwik8`` reads the raw file byte by byte (the usual 90M/5M/5M split; ``--enwik8_bytes`` caps what is read), so
bits per character are bits per byte. ``--model`` (a hub name or path) continues training a pretrained model with
memory layers added (its own tokenizer; bits per character = summed loss / characters / ln 2).

Every option: python recipes/titans_lm.py --help
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

NAMES = ("Ada", "Bram", "Cleo", "Dov", "Esme", "Finn", "Gia", "Hugo", "Ines", "Jory")
THINGS = ("lamp", "key", "book", "cup", "coin", "map", "bell", "kite", "ring", "drum")
COLORS = ("red", "blue", "green", "gold", "gray", "white", "black", "pink")
PLACES = ("attic", "garden", "cellar", "kitchen", "study", "porch", "barn", "hall")


def recall_stories(n_chars: int, seed: int) -> str:
    """Generated text where later sentences repeat facts stated earlier in the same story (what a memory is for):
    ``"Ada hid the red lamp in the attic. ... Where is the red lamp? In the attic, said Ada."``"""
    import random

    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        facts = [(rng.choice(NAMES), rng.choice(COLORS), rng.choice(THINGS), rng.choice(PLACES)) for _ in range(3)]
        story = " ".join(f"{n} hid the {c} {t} in the {p}." for n, c, t, p in facts)
        for n, c, t, p in rng.sample(facts, 2):
            story += f" Where is the {c} {t}? In the {p}, said {n}."
        parts.append(story + "\n")
        size += len(parts[-1])
    return "".join(parts)[:n_chars]


def read_enwik8(path: str, limit: int | None) -> tuple[str, str]:
    """``(train, valid)`` text from the raw enwik8 file: bytes as latin-1 characters, split 90M / 5M."""
    with open(path, "rb") as f:
        data = f.read(limit) if limit else f.read()
    n_train = min(90_000_000, int(len(data) * 0.9))
    n_valid = min(5_000_000, len(data) - n_train)
    return data[:n_train].decode("latin-1"), data[n_train:n_train + n_valid].decode("latin-1")


def encode_chars(tok, text: str) -> list[int]:
    """Character-level ids by table lookup (the tokenizer's vocabulary; unknown characters map to ``<unk>``)."""
    vocab = tok.get_vocab()
    unk = tok.unk_token_id
    return [vocab.get(c, unk) for c in text]


def windows(ids: list[int], seq: int, n: int, seed: int) -> list[dict]:
    """``n`` random training windows of ``seq`` tokens."""
    import random

    rng = random.Random(seed)
    top = max(len(ids) - seq, 0)
    out = []
    for _ in range(n):
        s = rng.randint(0, top)
        block = ids[s:s + seq]
        out.append({"input_ids": block, "labels": block})
    return out


def evaluate(model, ids: list[int], seq: int, batch: int, max_tokens: int) -> tuple[float, int]:
    """``(summed loss in nats, predicted tokens)`` over consecutive held-out blocks (each from a fresh memory)."""
    import torch

    device = next(model.parameters()).device
    blocks = [ids[i:i + seq] for i in range(0, min(len(ids), max_tokens) - 1, seq)]
    blocks = [b for b in blocks if len(b) == seq] or ([ids[:max(len(ids), 2)]] if len(ids) > 1 else [])
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            x = torch.tensor(blocks[i:i + batch], device=device)
            out = model(input_ids=x, labels=x)
            n = x.numel() - x.shape[0]
            total += out.loss.float().item() * n
            count += n
    model.train(was_training)
    return total, count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--text", default=None, help="a UTF-8 text file (90%% train, 10%% held out); default: built-in")
    data.add_argument("--builtin", default="stories", choices=["stories", "demo_text"],
                      help="built-in data when no file is given: generated recall stories (default; facts stated "
                           "early in a story are asked for later) or memgrad_hf.offline.DEMO_TEXT (1.7K chars)")
    data.add_argument("--enwik8", default=None, help="path to the raw enwik8 file (byte level)")
    data.add_argument("--enwik8_bytes", type=int, default=None, help="read only the first N bytes of enwik8")
    model_g = p.add_argument_group("model")
    model_g.add_argument("--model", default=None, help="hub name or path to add memory to; default: a new tiny Llama")
    model_g.add_argument("--model_dim", type=int, default=64,
                         help="hidden size of the new model (default: %(default)s)")
    model_g.add_argument("--layers", type=int, default=2, help="decoder layers of the new model (default: %(default)s)")
    model_g.add_argument("--attn_heads", type=int, default=4,
                         help="attention heads of the new model (default: %(default)s)")
    model_g.add_argument("--memory_layers", type=int, nargs="+", default=[-1],
                         help="decoder layers given memory (default: %(default)s)")
    model_g.add_argument("--memory_heads", type=int, default=2, help="heads of each memory (default: %(default)s)")
    model_g.add_argument("--memory_depth", type=int, default=2,
                         help="layers of the memory MLP (1-4) (default: %(default)s)")
    model_g.add_argument("--chunk_size", type=int, default=16, help="tokens per memory update (default: %(default)s)")
    model_g.add_argument("--max_lr", type=float, default=0.1,
                         help="memory's inner learning rate ceiling (default: %(default)s)")
    model_g.add_argument("--grad_impl", default="manual", choices=["manual", "autograd"],
                         help="exact inner gradient: manual kernel or the torch.func reference")
    fan_g = p.add_argument_group("FAN")
    fan_g.add_argument("--fan_distill_steps", type=int, default=None,
                       help="distil a FAN for N steps, then use it instead of the exact gradient; 0: no FAN "
                            "(default: half of --max_steps, at least 1)")
    fan_g.add_argument("--fan_distill_epochs", type=float, default=None, help="or switch after this many epochs")
    fan_g.add_argument("--fan_norm_weight", type=float, default=0.1,
                       help="weight of the FAN's log-norm loss term (default: %(default)s)")
    train = p.add_argument_group("training")
    train.add_argument("--seq", type=int, default=192, help="tokens per example (default: %(default)s)")
    train.add_argument("--batch", type=int, default=8, help="examples per step (default: %(default)s)")
    train.add_argument("--max_steps", type=int, default=200, help="optimizer steps (default: %(default)s)")
    train.add_argument("--learning_rate", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    train.add_argument("--optim", default="adamw_torch",
                       help="any Trainer optimizer name (adamw_torch, forge_adamw) (default: %(default)s)")
    train.add_argument("--logging_steps", type=int, default=None, help="default: max_steps / 10")
    train.add_argument("--eval_tokens", type=int, default=4096,
                       help="held-out tokens evaluated at the end (default: %(default)s)")
    train.add_argument("--bf16", action="store_true",
                       help="a hub model loads in bf16, and the Trainer runs bf16 (default: fp32)")
    train.add_argument("--seed", type=int, default=0, help="model, data and Trainer seed (default: %(default)s)")
    train.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads (default: 1 for a new model on CPU, else torch's default)")
    train.add_argument("--output_dir", default="/tmp/memgrad_titans_lm",
                       help="the trained model is saved here (default: %(default)s)")
    a = p.parse_args(argv)

    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    import memgrad_hf
    from memgrad_hf.callbacks import FANDistillationCallback
    from memgrad_hf.offline import DEMO_TEXT, build_char_tokenizer
    from memgrad_hf.titans import TitansConfig

    if a.enwik8 is None and a.text is None and a.model is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    threads = a.threads or (1 if a.model is None and not torch.cuda.is_available() else None)
    if threads:  # the tiny model's ops are too small to gain from threads; on a busy CPU they lose badly
        torch.set_num_threads(threads)
    if (a.fan_distill_steps or 0) < 0 or (a.fan_distill_epochs is not None and a.fan_distill_epochs <= 0):
        p.error("--fan_distill_steps takes N >= 0 (0: no FAN), --fan_distill_epochs a number > 0")
    distill = a.fan_distill_steps if a.fan_distill_steps is not None else (
        None if a.fan_distill_epochs is not None else max(1, a.max_steps // 2))
    use_fan = a.fan_distill_epochs is not None or bool(distill)

    # -- data ------------------------------------------------------------------------------------------------------
    if a.enwik8:
        train_text, valid_text = read_enwik8(a.enwik8, a.enwik8_bytes)
        source = f"enwik8 ({len(train_text):,} train / {len(valid_text):,} valid bytes)"
    else:
        if a.text:
            with open(a.text, encoding="utf-8") as f:
                text = f.read()
            cut = int(len(text) * 0.9)
            train_text, valid_text = text[:cut], text[cut:]
        elif a.builtin == "demo_text":
            text = DEMO_TEXT
            cut = int(len(text) * 0.9)
            train_text, valid_text = text[:cut], text[cut:]
        else:  # held-out stories from another seed: same grammar, new facts
            train_text, valid_text = recall_stories(200_000, a.seed), recall_stories(20_000, a.seed + 1)
        source = f"{a.text or a.builtin} ({len(train_text):,} train / {len(valid_text):,} held-out chars)"

    torch.manual_seed(a.seed)
    if a.model is None:
        tok = build_char_tokenizer("".join(sorted(set(train_text + valid_text))))
        train_ids, valid_ids = encode_chars(tok, train_text), encode_chars(tok, valid_text)
        heads = a.attn_heads
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tok), hidden_size=a.model_dim, intermediate_size=4 * a.model_dim,
            num_hidden_layers=a.layers, num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
            max_position_embeddings=max(a.seq, 256), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id))
    else:
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if a.bf16 else torch.float32)
        train_ids = tok(train_text, add_special_tokens=False).input_ids
        valid_ids = tok(valid_text, add_special_tokens=False).input_ids
    chars_per_token = len(valid_text) / max(len(valid_ids), 1)

    titans = TitansConfig(layers=a.memory_layers, heads=a.memory_heads, depth=a.memory_depth,
                          chunk_size=a.chunk_size, max_lr=a.max_lr, grad_impl=a.grad_impl, fan=use_fan)
    memgrad_hf.patch_model(model, titans=titans)
    from memgrad_hf.callbacks.titans import fan_memories
    from memgrad_hf.titans import NeuralMemory

    memories = [m for m in model.modules() if isinstance(m, NeuralMemory)]
    for m in fan_memories(model):
        m.fan.norm_weight = a.fan_norm_weight
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {n_params:,} parameters; memory on layers "
          f"{model.config.memgrad_titans['layers']} "
          f"({len(memories)} x NeuralMemory, heads {a.memory_heads}, depth {a.memory_depth}, chunk {a.chunk_size})")
    print(f"data: {source}; vocab {len(tok)}")

    data_rows = windows(train_ids, a.seq, a.max_steps * a.batch, a.seed)

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                extra = ""
                if "fan_cosine" in logs:
                    mode = "fan" if logs["fan_mode"] else "distilling"
                    extra = (f"  fan_cosine {logs['fan_cosine']:.3f} ({mode})  "
                             f"exact_grad_calls {logs['fan_exact_grad_calls']}  fan_calls {logs['fan_calls']}")
                print(f"step {state.global_step:>5}  loss {logs['loss']:.4f}{extra}", flush=True)

    callbacks: list = []
    fan_cb = None
    if use_fan:
        fan_cb = FANDistillationCallback(distill_steps=distill or None, distill_epochs=a.fan_distill_epochs)
        callbacks.append(fan_cb)
    callbacks.append(Progress())  # after the FAN callback, so that its metrics are in the logs
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=a.batch,
        learning_rate=a.learning_rate, lr_scheduler_type="cosine", warmup_steps=max(a.max_steps // 20, 1),
        logging_steps=a.logging_steps or max(a.max_steps // 10, 1), save_strategy="no", report_to="none",
        bf16=a.bf16, use_cpu=not torch.cuda.is_available(), optim=a.optim, disable_tqdm=True,
        dataloader_num_workers=0, seed=a.seed,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data_rows, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # Progress prints the logs
    t0 = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - t0
    exact_after_train = sum(m.exact_grad_calls for m in memories)

    # -- summary ---------------------------------------------------------------------------------------------------
    logs = [h for h in trainer.state.log_history if "loss" in h]
    final_loss = logs[-1]["loss"] if logs else float("nan")

    def bpc() -> float:
        nats, n = evaluate(model, valid_ids, a.seq, a.batch, a.eval_tokens)
        return nats / max(n, 1) / chars_per_token / math.log(2)

    bpc_mode = bpc()  # the memories' current gradient (the FAN after a switch)
    print(f"\nTitans LM done: {a.max_steps} steps in {elapsed:.1f} s; final train loss {final_loss:.4f} "
          f"({final_loss / math.log(2) / chars_per_token:.3f} bits/char); held-out {bpc_mode:.3f} bits/char "
          f"with the {'FAN' if fan_cb and fan_cb.switched else 'exact'} inner gradient")
    if fan_cb is not None:
        s = fan_cb.summary
        if fan_cb.switched:
            for m in memories:
                m.grad_impl = a.grad_impl
            bpc_exact = bpc()
            for m in memories:
                m.grad_impl = "fan"
            print(f"FAN: cosine(predicted, exact inner gradient) {s['cosine_at_switch']:.3f} at the switch "
                  f"(step {s['switch_step']}); exact_grad_calls {s['exact_calls_at_switch']} at the switch, "
                  f"{exact_after_train} at the end of training (no exact call after the switch); "
                  f"{s['fan_calls']} FAN chunk calls; held-out with the exact gradient instead: {bpc_exact:.3f} "
                  f"bits/char")
        else:
            print(f"FAN: still distilling at the end; cosine {s['fan_cosine']:.3f}")
    return 0


if __name__ == "__main__":
    from memgrad_hf.offline import run_recipe

    sys.exit(run_recipe(main))
