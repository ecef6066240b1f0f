"""Which transformers causal-LM families the chunked head patches exactly (``memgrad-hf bench compat``).

For every model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny config is derived from the family's default
config (common size fields shrunk), the model is built twice from one seed, one copy is patched, and the loss and
every parameter gradient of a training forward with ``-100`` labels are compared (1e-5 relative, fp32).

Statuses: ``exact``; ``unsupported`` (memgrad raised ``UnsupportedModelError``: the message says why);
``MISMATCH`` / ``ERROR`` (a memgrad bug: please report); ``untested`` (the shrunk config could not be built or the
*unpatched* model failed on it — says nothing about memgrad).
"""

from __future__ import annotations

import argparse
import copy
import signal
import sys
import warnings
from collections import Counter

import torch

SHRINK = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=101, head_dim=8, n_embd=32, n_layer=2, n_head=4, d_model=32, ffn_dim=64, n_inner=64, num_layers=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    num_experts_per_tok=2, max_position_embeddings=64, n_positions=64, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, decoder_start_token_id=0,
)


class _Timeout(Exception):
    pass


def _tiny(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoConfig.for_model(family)
    cfg = AutoConfig.for_model(family, **{k: v for k, v in SHRINK.items() if hasattr(base, k)})
    if hasattr(cfg, "get_text_config"):
        text = cfg.get_text_config()
        for k, v in SHRINK.items():
            if hasattr(text, k):
                try:
                    setattr(text, k, v)
                except Exception:
                    pass
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def check(family: str) -> tuple[str, str]:
    import memgrad_hf

    try:
        model = _tiny(family)
    except Exception as e:
        return "untested", f"tiny config: {type(e).__name__}: {str(e)[:70]}"
    ref = copy.deepcopy(model)
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else 101
    ids = torch.randint(3, min(vocab, 101), (2, 8))
    labels = ids.clone()
    labels[0, :2] = -100
    try:
        torch.manual_seed(1)
        r = ref(input_ids=ids, labels=labels)
        r.loss.backward()
    except Exception as e:
        return "untested", f"unpatched model fails on the tiny config: {type(e).__name__}: {str(e)[:60]}"
    try:
        memgrad_hf.patch_model(model, chunk_size=4)
        torch.manual_seed(1)
        o = model(input_ids=ids, labels=labels)
        o.loss.backward()
    except memgrad_hf.UnsupportedModelError as e:
        return "unsupported", str(e)[:110]
    except Exception as e:
        return "ERROR", f"{type(e).__name__}: {str(e)[:100]}"
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True) if q.grad is not None]
    scale = max(q.abs().max().item() for _, q in pairs)
    same_loss = abs(o.loss.item() - r.loss.item()) <= 1e-5 * abs(r.loss.item())
    same_grads = all(
        p is not None and (p - q).abs().max().item() <= 1e-5 * q.abs().max().item() + 1e-6 * scale for p, q in pairs
    )
    return ("exact" if same_loss and same_grads else "MISMATCH"), type(model).__name__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memgrad-hf bench compat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("families", nargs="*", help="model types (default: every causal-LM model type)")
    p.add_argument("--timeout", type=int, default=30, help="seconds per family")
    a = p.parse_args(argv)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    families = a.families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

    def on_alarm(*_: object) -> None:
        raise _Timeout

    signal.signal(signal.SIGALRM, on_alarm)
    results = {}
    for fam in families:
        signal.alarm(a.timeout)
        try:
            results[fam] = check(fam)
        except _Timeout:
            results[fam] = ("untested", f"over {a.timeout}s")
        finally:
            signal.alarm(0)
    print("| model type | status | detail |\n|---|---|---|")
    for fam, (status, detail) in results.items():
        print(f"| {fam} | {status} | {detail.replace('|', '/')} |")
    counts = Counter(s for s, _ in results.values())
    print("\n" + ", ".join(f"{k}: {v}" for k, v in counts.most_common()))
    return 1 if counts.get("MISMATCH") or counts.get("ERROR") else 0


if __name__ == "__main__":
    sys.exit(main())
