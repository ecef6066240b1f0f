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
    """Returns ``(kernel vs twin, 0)`` on CPU; compiled, ``(kernel vs fp64 twin, twin vs fp64 twin)`` with the
    second NaN when the kernel is further from fp64 than the twin allows (4x the twin's error or 2 fp32 spacings)."""
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
    # where the weight is far larger than its update, one fp32 rounding of w (an FMA contracted or not) is already
    # a visible fraction of the update: count the kernel's weight error in fp32 spacings at the weight's scale too
    ulps = ((w2.double() - w3).abs().max() / (torch.finfo(torch.float32).eps * w3.abs().max())).item()
    print(f"{rule} acc={with_acc} step={step}: kernel vs twin {vs_twin:.2e}; vs fp64: kernel {kernel:.2e}, "
          f"twin {twin:.2e}; kernel weights within {ulps:.2f} fp32 spacings (at max |w|) of fp64")
    return kernel, twin if kernel <= max(1e-5, 4 * twin) or ulps <= 2.0 else float("nan")


def check_bf16(rule: str, step: int, device: str = "cpu") -> float:
    """bf16 activations and weights, fp32 state (the tensor-core path). The activations are multiples of 1/4 in
    [-2, 2), so every product and sum of the weight gradient is exact in fp32 whatever the order: kernel and twin
    then see the same bf16 gradient, and their weights may differ only where one rounding to bf16 falls the other
    way (one spacing). Returns the largest difference in bf16 spacings; raises if the state differs."""
    g = torch.Generator().manual_seed(step)
    n, out_f, in_f = 72, 80, 72
    dy, x = (torch.randint(-8, 8, (n, f), generator=g) / 4 for f in (out_f, in_f))
    w = torch.randn(out_f, in_f, generator=g)
    names = K.RULES[rule][1]
    st = {k: torch.rand(out_f, in_f, generator=g) * (0.1 if k == "exp_avg_sq" else 1.0) for k in names}
    dy, x, w = (t.to(device, torch.bfloat16) for t in (dy, x, w))
    st = {k: v.to(device) for k, v in st.items()}
    hp = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    w1, st1 = w.clone(), {k: v.clone() for k, v in st.items()}
    w2, st2 = w.clone(), {k: v.clone() for k, v in st.items()}
    K.linear_weight_step(rule, dy, x, w1, st1, hp, step, None, rows_per_tile=16)
    T.linear_weight_step(rule, dy, x, w2, st2, hp, step, None)
    spacing = torch.finfo(torch.bfloat16).eps * w1.float().abs().clamp_min(1e-3)
    ulps = ((w1.float() - w2.float()).abs() / spacing).max().item()
    for k in names:
        err = ((st1[k] - st2[k]).abs().max() / st1[k].abs().max()).item()
        assert err < 1e-5, (rule, k, err)
    print(f"bf16 {rule} step={step}: weights differ by at most {ulps:.2f} bf16 spacings")
    return ulps


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    results = [check(rule, acc, step, dev) for rule in ("adamw", "lion") for acc in (False, True) for step in (1, 7)]
    worst = max(r[0] for r in results)
    bf16_ok = max(check_bf16(rule, step, dev) for rule in ("adamw", "lion") for step in (1, 7)) <= 1.0
    if dev == "cpu":
        print(f"max relative error {worst:.3e}")
        sys.exit(0 if worst < 1e-5 and bf16_ok else 1)
    ok = bf16_ok and not any(t != t for _, t in results)
    print(f"max relative error vs fp64: kernel {worst:.3e}, twin {max(r[1] for r in results):.3e}")
    sys.exit(0 if ok else 1)
