"""Run without TRITON_INTERPRET (by test_triton_launch.py): FORGE's launches through ``triton_launch.Launcher`` pick
the variant Triton's own binder picks and pass it the same arguments, over cases that change every specialization
Triton makes (dtypes, 16-byte alignment, ints equal to 1 or divisible by 16, constexprs) and back, in a shuffled
order so that later calls reuse variants launched for other arguments. Triton's Python runs for real on CPU; only
compiling and the C launch are stand-ins (``fake_triton_driver``). Prints ``direct launches: N``."""

import random
import sys

from tests import fake_triton_driver as FD

FD.install()

import torch  # noqa: E402

from memgrad_hf.kernels import forge as K  # noqa: E402
from memgrad_hf.kernels import forge_triton as T  # noqa: E402
from memgrad_hf.kernels import triton_launch as L  # noqa: E402


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values at an address 1 element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


def _state(rule: str, kind: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    st = {}
    for name in K.RULES[rule][1]:
        if kind == "q8":
            st[name] = torch.zeros(shape, dtype=K.Q_DTYPE)
            st[name + ".scale"] = torch.ones(shape[0], shape[1] // K.Q_BLOCK)
        else:
            st[name] = torch.zeros(shape, dtype=torch.bfloat16 if kind == "bf16" else torch.float32)
    return st


def _hp(rule: str) -> dict:
    if rule.startswith("sgd"):
        return {"lr": 1e-2, "momentum": 0.9 if rule == "sgd_momentum" else 0.0, "dampening": 0.0,
                "nesterov": False, "weight_decay": 0.1}
    return {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def cases() -> list:
    """``(name, call)`` pairs; each call launches FORGE's kernel once (or once per tile) with fresh tensors."""
    out = []
    for rule in ("adamw", "lion", "sgd", "sgd_momentum"):
        for n in (1, 16, 17, 64):  # tokens: 1 is a constant to Triton, 16 and 64 divisible by 16, 17 neither
            for act, wdt, state in (("fp32", "fp32", "fp32"), ("bf16", "bf16", "bf16"), ("bf16", "fp32", "q8"),
                                    ("bf16", "bf16", "q8")):
                for shape in ((64, 128), (80, 64), (48, 192)):
                    for variant in ("plain", "acc", "misaligned", "coef", "sr", "step1"):
                        out.append((f"{rule} n={n} {act}/{wdt}/{state} {shape} {variant}",
                                    _linear_call(rule, n, act, wdt, state, shape, variant)))
        for shape in ((64, 128), (1, 96), (3, 64), (192,)):
            for state in ("fp32", "bf16", "q8"):
                if state == "q8" and shape[-1] % K.Q_BLOCK:
                    continue
                out.append((f"update {rule} {shape} {state}", _update_call(rule, shape, state)))
    return out


def _linear_call(rule, n, act, wdt, state, shape, variant):
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def call():
        g = torch.Generator().manual_seed(n * 7 + shape[0])
        out_f, in_f = shape
        dy = torch.randn(n, out_f, generator=g).to(dt[act])
        x = torch.randn(n, in_f, generator=g).to(dt[act])
        if variant == "misaligned":
            x = _misaligned(x)
        w = torch.randn(out_f, in_f, generator=g).to(dt[wdt])
        acc = torch.randn(out_f, in_f, generator=g).to(dt[wdt]) if variant == "acc" else None
        T.linear_weight_step(rule, dy, x, w, _state(rule, state, shape), _hp(rule), 1 if variant == "step1" else 5,
                             acc, stochastic_rounding=variant == "sr", seed=random.randrange(1 << 30),
                             coef=0.5 if variant == "coef" else 1.0)
    return call


def _update_call(rule, shape, state):
    def call():
        g = torch.Generator().manual_seed(sum(shape))
        p = torch.randn(shape, generator=g)
        st = _state(rule, state, p.view(-1, shape[-1]).shape)
        T.update_step(rule, p, torch.randn(shape, generator=g), st, _hp(rule), 3, seed=random.randrange(1 << 30),
                      offset=random.choice((0, 1, 16, 1 << 20)))
    return call


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and x.shape == y.shape and x.data_ptr() % 16 == y.data_ptr() % 16
                    and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def main() -> int:
    random.seed(0)
    all_cases = cases()
    order = all_cases * 2
    random.Random(0).shuffle(order)
    failed = 0
    for name, call in order:
        state = random.getstate()
        L.ENABLED = False  # (MEMGRAD_TRITON_LAUNCH=jit)
        FD.LAUNCHES.clear()
        call()
        triton_launches = list(FD.LAUNCHES)
        L.ENABLED = True
        random.setstate(state)  # (the same seeds and offsets)
        FD.LAUNCHES.clear()
        call()
        ours = list(FD.LAUNCHES)
        ok = len(ours) == len(triton_launches) and all(
            k1 is k2 and _same(a1, a2) for (k1, a1), (k2, a2) in zip(ours, triton_launches, strict=True))
        if not ok:
            failed += 1
            print(f"FAILED {name}: Triton launched {[k.key[:60] for k, _ in triton_launches]}, "
                  f"the launcher {[k.key[:60] for k, _ in ours]}")
    direct = T._launch_linear.direct
    print(f"{len(order)} calls, {len(FD.VARIANTS)} variants, direct launches: {direct}, {failed} failed")
    return 1 if failed or direct < len(order) // 2 else 0


if __name__ == "__main__":
    sys.exit(main())
