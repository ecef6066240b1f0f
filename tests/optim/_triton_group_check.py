"""``update_many`` (one grouped launch per kind of tensor) against one ``update_step`` launch per tensor, on the same
inputs: state must be bit-identical and weights too (the same arithmetic per element), the norm² sums equal within
fp32 summation order, the skipped-tile counts equal. Run under ``TRITON_INTERPRET=1`` on CPU
(tests/optim/test_forge_triton.py) or on a GPU (``python tests/optim/_triton_group_check.py cuda``).

One exception under the interpreter only: it computes arithmetic between scalar kernel arguments in fp64 (``lr /
bc1`` of the one-tensor launch: 0.00738007389 where fp32 gives 0.00738007436), while the grouped kernel reads those
scalars from an fp32 table; compiled, both are fp32. So on CPU an fp32 weight may be one fp32 spacing apart."""

from __future__ import annotations

import copy
import sys

import torch

from memgrad_hf.kernels import forge as K
from memgrad_hf.kernels import forge_triton as FT

DEV = sys.argv[1] if len(sys.argv) > 1 else "cpu"


def _state(rule: str, p: torch.Tensor, kind: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Non-trivial state of ``kind`` ("fp32", "bf16", "8bit") for ``p``, as the optimizer keeps it."""
    st = {}
    for name in K.RULES[rule][1]:
        x = torch.randn(p.shape, generator=gen) * 1e-2
        if name == "exp_avg_sq":
            x = x.abs()
        if kind == "8bit" and p.dim() == 2 and p.shape[1] % K.Q_BLOCK == 0:  # (as the optimizer's 8-bit state)
            positive = name == "exp_avg_sq"
            st[name], st[name + ".scale"] = K.quantize_8bit(x.sqrt() if positive else x, positive=positive)
        else:
            st[name] = x.to(torch.bfloat16 if kind == "bf16" else torch.float32)
    return {k: v.to(DEV) for k, v in st.items()}


def _items(rule: str, w_dtype: torch.dtype, kind: str, gen: torch.Generator, nonfinite: bool) -> list:
    """Tensors of several shapes (a norm's 1-row gain, a matrix, a row block of a larger one, a bias), each with its
    own learning rate, seed and offset; one of them with a non-finite gradient."""
    shapes = [(48,), (70, 128), (128, 64), (5,)]
    items = []
    for i, shape in enumerate(shapes):
        p = (torch.randn(shape, generator=gen) * 0.1).to(w_dtype).to(DEV)
        g = (torch.randn(shape, generator=gen) * 1e-2).to(w_dtype).to(DEV)
        if i == 2 and nonfinite:
            g[3, 5] = float("nan")  # its tile is skipped in both
        hp = {"lr": 1e-3 * (i + 1), "weight_decay": 0.01 * i, "betas": (0.9, 0.99 if rule == "lion" else 0.999),
              "eps": 1e-8, "momentum": 0.9, "dampening": 0.1, "nesterov": i % 2 == 1}
        items.append((p, g, _state(rule, p, kind, gen), hp, 3, 17 * i + 1, 1000 * i))
    return items


def _weights_match(a: torch.Tensor, b: torch.Tensor, before: torch.Tensor) -> bool:
    if DEV != "cpu" or a.dtype != torch.float32:
        return torch.equal(a, b)
    # (see the module docstring) one fp32 spacing of the update (its step size rounded differently), plus one of the
    # weight (the sum's rounding)
    def spacing(x: torch.Tensor) -> torch.Tensor:
        return torch.nextafter(x, torch.tensor(float("inf"))) - x

    tol = spacing((b - before).abs()) + spacing(torch.maximum(b.abs(), before.abs()))
    return bool(((a - b).abs() <= tol).all())


def check_training_launches_grouped(max_grad_norm: float) -> bool:
    """In training, with ``MEMGRAD_FORGE_GROUPED=1``: FORGE's exact-clipping replay (``max_grad_norm > 0``) hands the
    updates of its kept tiles and hooked parameters to one ``update_many`` call per step (one launch per kind of
    tensor); without clipping, the backward's small hooked tensors (norms' gains; the tiny embedding's rows) go out
    together when it ends. The weights equal ``torch.optim.AdamW`` (+ ``clip_grad_norm_``) after 3 plain-loop steps
    of a tiny Llama, fp32, every step clipping where it clips."""
    import os

    from memgrad_hf.optim import ForgeAdamW
    from tests.tiny_models import tiny_model

    os.environ["MEMGRAD_BACKEND"] = "triton"
    os.environ["MEMGRAD_FORGE_GROUPED"] = "1"
    calls = {"update_many": [], "update_step": 0}
    many, one = FT.update_many, FT.update_step

    def counting_many(rule, items, **kw):
        calls["update_many"].append(len(items))
        return many(rule, items, **kw)

    def counting_one(*a, **kw):
        calls["update_step"] += 1
        return one(*a, **kw)

    FT.update_many, FT.update_step = counting_many, counting_one
    # every linear layer's dW tiles kept for the replay, as where the memory headroom allows (a GPU at batch 1; on
    # CPU the resident set's high-water mark often leaves none)
    may_keep = ForgeAdamW._may_keep
    ForgeAdamW._may_keep = lambda self, weight: True
    try:
        torch.manual_seed(0)
        model = tiny_model("llama").to(DEV)
        ref = copy.deepcopy(model)
        opt = ForgeAdamW(model.parameters(), model=model, lr=1e-2, weight_decay=0.1, max_grad_norm=max_grad_norm)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(3):
            ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(step)).to(DEV)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            ref(input_ids=ids, labels=ids).loss.backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
            ref_opt.step()
            ref_opt.zero_grad()
    finally:
        FT.update_many, FT.update_step = many, one
        ForgeAdamW._may_keep = may_keep
        os.environ.pop("MEMGRAD_BACKEND", None)
        os.environ.pop("MEMGRAD_FORGE_GROUPED", None)
    err = max(((p - q).norm() / q.norm()).item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    n_params = sum(1 for _ in model.parameters())
    if max_grad_norm:  # all but the embedding (its replay walks row blocks it makes itself: launched one by one)
        want = n_params - 1
    else:  # the hooked ones (norms) and the fused embedding's rows: linear weights update inside their layer
        want = sum(1 for p in model.parameters() if p.dim() == 1) + 1
    ok = err < 1e-5 and calls["update_many"] == [want] * 3 and (max_grad_norm or calls["update_step"] == 0)
    print(f"{'ok' if ok else 'FAILED'} {'replay' if max_grad_norm else 'no clipping'}: grouped items per step "
          f"{calls['update_many']} of {n_params} parameters, {calls['update_step']} single launches, weights vs "
          f"torch.optim.AdamW{' + clip_grad_norm_' if max_grad_norm else ''} {err:.1e}")
    return ok


def main() -> int:
    worst = 0.0
    failed = [what for what, clip in (("replay", 0.05), ("no clipping", 0.0))
              if not check_training_launches_grouped(clip)]
    for rule in ("adamw", "lion", "sgd_momentum", "sgd"):
        for w_dtype, kind, sr in ((torch.float32, "fp32", False), (torch.bfloat16, "bf16", True),
                                  (torch.bfloat16, "8bit", False), (torch.float32, "8bit", True)):
            if rule.startswith("sgd") and kind != "fp32":
                continue
            for coef in (1.0, 0.5):
                nonfinite = coef != 1.0
                items = _items(rule, w_dtype, kind, torch.Generator().manual_seed(0), nonfinite)
                twin = copy.deepcopy(items)
                before = [it[0].clone() for it in items]
                s1 = FT.update_many(rule, items, coef=coef, stochastic_rounding=sr)
                s2 = (torch.zeros((), device=DEV), torch.zeros((), dtype=torch.int32, device=DEV))
                for p, g, st, hp, step, seed, off in twin:
                    FT.update_step(rule, p, g, st, hp, step, coef=coef, stochastic_rounding=sr, seed=seed,
                                   offset=off, sums=s2)
                same = all(_weights_match(a[0], b[0], w0) and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
                           for a, b, w0 in zip(items, twin, before, strict=True))
                if nonfinite:  # (the skipped tile's Σ g² is in both norms: NaN)
                    norm_err = 0.0 if s1[0].isnan() and s2[0].isnan() else float("inf")
                else:
                    norm_err = abs(s1[0].item() - s2[0].item()) / max(abs(s2[0].item()), 1e-30)
                worst = max(worst, norm_err)
                ok = same and int(s1[1]) == int(s2[1]) == int(nonfinite) and norm_err < 1e-5
                what = f"{rule} {w_dtype} {kind} state sr={sr} coef={coef}"
                print(f"{'ok' if ok else 'FAILED'} {what}: identical={same}, skipped {int(s1[1])}/{int(s2[1])}, "
                      f"norm² rel err {norm_err:.1e}")
                if not ok:
                    failed.append(what)
    print(f"grouped vs one launch per tensor: {len(failed)} failed, norm² max rel err {worst:.1e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
