"""Run under TRITON_INTERPRET=1 (by test_forge_triton.py): the Triton FORGE kernel against its torch twin.

On a GPU machine: ``python tests/optim/_triton_twin_check.py cuda`` runs the compiled kernel instead."""

import sys

import torch

from memgrad_hf.kernels import forge as K
from memgrad_hf.kernels import forge_triton as T


def _errs(w0, w, st, n, w_ref, st_ref, n_ref, names) -> float:
    errs = [((w - w_ref).abs().max() / (w0 - w_ref).abs().max()).item(), abs(n.item() - n_ref.item()) / n_ref.item()]
    errs += [((st[k] - st_ref[k]).abs().max() / st_ref[k].abs().max()).item() for k in names]
    return max(errs)


def check(rule: str, with_acc: bool, step: int, device: str = "cpu") -> tuple[float, float]:
    """Returns ``(kernel vs twin, twin vs fp64 twin)``; the second is 0 on CPU (not needed there)."""
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
    vs_twin = _errs(w, w2, st2, n2, w1, st1, n1, names)
    if device == "cpu":  # the interpreter does the twin's arithmetic: they must agree to rounding
        return vs_twin, 0.0
    # Compiled, the kernel sums dW in another order than cuBLAS, and Adam's 1/sqrt(v) magnifies that rounding
    # where v is small; so both are held against the fp64 twin: the kernel must be as close to it as the twin.
    w3, st3 = w.double(), {k: v.double() for k, v in st.items()}
    n3, _ = K.linear_weight_step(rule, dy.double(), x.double(), w3, st3, hp, step,
                                 None if acc is None else acc.double(), rows_per_tile=16)
    w64 = w.double()
    kernel = _errs(w64, w2.double(), {k: v.double() for k, v in st2.items()}, n2.double(), w3, st3, n3, names)
    twin = _errs(w64, w1.double(), {k: v.double() for k, v in st1.items()}, n1.double(), w3, st3, n3, names)
    print(f"{rule} acc={with_acc} step={step}: kernel vs twin {vs_twin:.2e}; vs fp64: kernel {kernel:.2e}, "
          f"twin {twin:.2e}")
    return kernel, twin


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    results = [check(rule, acc, step, dev) for rule in ("adamw", "lion") for acc in (False, True) for step in (1, 7)]
    worst = max(r[0] for r in results)
    if dev == "cpu":
        print(f"max relative error {worst:.3e}")
        sys.exit(0 if worst < 1e-5 else 1)
    ok = all(k <= max(1e-5, 4 * t) for k, t in results)
    print(f"max relative error vs fp64: kernel {worst:.3e}, twin {max(r[1] for r in results):.3e}")
    sys.exit(0 if ok else 1)
