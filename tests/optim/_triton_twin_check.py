"""Run under TRITON_INTERPRET=1 (by test_forge_triton.py): the Triton FORGE kernel against its torch twin.

On a GPU machine: ``python tests/optim/_triton_twin_check.py cuda`` runs the compiled kernel instead."""

import sys

import torch

from memgrad_hf.kernels import forge as K
from memgrad_hf.kernels import forge_triton as T


def check(rule: str, with_acc: bool, step: int, device: str = "cpu") -> float:
    g = torch.Generator().manual_seed(step)
    n, out_f, in_f = 40, 48, 40  # not multiples of the 32-wide tiles: exercises the masks
    dy, x = torch.randn(n, out_f, generator=g), torch.randn(n, in_f, generator=g)
    w = torch.randn(out_f, in_f, generator=g)
    names = K.RULES[rule][1]
    st = {k: torch.rand(out_f, in_f, generator=g) * (0.1 if k == "exp_avg_sq" else 1.0) for k in names}
    acc = torch.randn(out_f, in_f, generator=g) if with_acc else None
    dy, x, w, acc = (None if t is None else t.to(device) for t in (dy, x, w, acc))
    st = {k: v.to(device) for k, v in st.items()}
    hp = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    w1, st1 = w.clone(), {k: v.clone() for k, v in st.items()}
    w2, st2 = w.clone(), {k: v.clone() for k, v in st.items()}
    n1, b1 = K.linear_weight_step(rule, dy, x, w1, st1, hp, step, acc, rows_per_tile=16)
    n2, b2 = T.linear_weight_step(rule, dy, x, w2, st2, hp, step, acc)
    assert int(b1) == int(b2) == 0
    errs = [((w1 - w2).abs().max() / (w - w1).abs().max()).item(), abs(n1.item() - n2.item()) / n1.item()]
    errs += [((st1[k] - st2[k]).abs().max() / st1[k].abs().max()).item() for k in names]
    return max(errs)


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    worst = max(check(rule, acc, step, dev) for rule in ("adamw", "lion") for acc in (False, True) for step in (1, 7))
    print(f"max relative error {worst:.3e}")
    sys.exit(0 if worst < 1e-5 else 1)
