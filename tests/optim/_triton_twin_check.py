"""Run under TRITON_INTERPRET=1 (by test_forge_triton.py): the Triton FORGE kernel against its torch twin.

On a GPU machine: ``python tests/optim/_triton_twin_check.py cuda`` runs the compiled kernel instead."""

import sys

import torch
import triton
import triton.language as tl

from memgrad_hf.kernels import forge as K
from memgrad_hf.kernels import forge_triton as T
from memgrad_hf.kernels import state_codes as S


def _code_step(values: torch.Tensor, name: str) -> torch.Tensor:
    """One code step at each of these (unscaled) 8-bit values: 2^-M of the value, 2^(-6-M) in the subnormal binade."""
    m = S.mantissa_bits(name == "exp_avg_sq")
    return 2.0**-m * values.abs() + 2.0 ** (-6 - m)


def _hp(rule: str, variant: bool = False) -> dict:
    """Hyper-parameters for ``rule``; SGD with momentum alternates Nesterov and dampening by ``variant``."""
    if rule.startswith("sgd"):
        mom = 0.9 if rule == "sgd_momentum" else 0.0
        return {"lr": 1e-2, "momentum": mom, "dampening": 0.3 if variant else 0.0,
                "nesterov": mom > 0 and not variant, "weight_decay": 0.1}
    return {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _errs(w0, w, st, n, w_ref, st_ref, n_ref, names) -> float:
    errs = [((w - w_ref).abs().max() / (w0 - w_ref).abs().max()).item(), abs(n.item() - n_ref.item()) / n_ref.item()]
    errs += [((st[k] - st_ref[k]).abs().max() / st_ref[k].abs().max()).item() for k in names]
    return max(errs) if all(e == e for e in errs) else float("inf")  # (a NaN fails: max() would pass it over)


def check(rule: str, with_acc: bool, step: int, device: str = "cpu", impl=None) -> tuple[float, float]:
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
    hp = _hp(rule, with_acc)
    w1, st1 = w.clone(), {k: v.clone() for k, v in st.items()}
    w2, st2 = w.clone(), {k: v.clone() for k, v in st.items()}
    n1, b1 = K.linear_weight_step(rule, dy, x, w1, st1, hp, step, acc, rows_per_tile=16)
    n2, b2 = (impl or T.linear_weight_step)(rule, dy, x, w2, st2, hp, step, acc)
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


def check_bf16(rule: str, step: int, device: str = "cpu", impl=None) -> float:
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
    hp = _hp(rule)
    w1, st1 = w.clone(), {k: v.clone() for k, v in st.items()}
    w2, st2 = w.clone(), {k: v.clone() for k, v in st.items()}
    K.linear_weight_step(rule, dy, x, w1, st1, hp, step, None, rows_per_tile=16)
    (impl or T.linear_weight_step)(rule, dy, x, w2, st2, hp, step, None)
    spacing = torch.finfo(torch.bfloat16).eps * w1.float().abs().clamp_min(1e-3)
    ulps = ((w1.float() - w2.float()).abs() / spacing).max().item()
    for k in names:
        err = ((st1[k] - st2[k]).abs().max() / st1[k].abs().max()).item()
        assert err < 1e-5, (rule, k, err)
    print(f"bf16 {rule} step={step}: weights differ by at most {ulps:.2f} bf16 spacings")
    return ulps


def check_lowp_state(rule: str, state: str, stochastic: bool, step: int, device: str = "cpu",
                     impl=None) -> float:
    """bf16 weights (rounded to nearest or stochastically) with bf16 or 8-bit state, against the twin. Exact
    gradients as in :func:`check_bf16`; the update's fp32 arithmetic may still differ in its last bit, so a rounding
    (nearest or stochastic: the noise is the same hash of the element index in both) may fall the other way for a
    few elements. Returns the fraction of weight and state values that differ; raises if any differs by more than
    one rounding step or if the scales differ."""
    g = torch.Generator().manual_seed(step + 100)
    n, out_f, in_f = 72, 80, 136  # 136 columns: a partial 64-wide 8-bit block at the end of each row
    dy, x = (torch.randint(-8, 8, (n, f), generator=g) / 4 for f in (out_f, in_f))
    dy[:, :8] = 0  # weight rows without a gradient so far: their state blocks are all zero and must stay so
    w = torch.randn(out_f, in_f, generator=g).to(device, torch.bfloat16)
    dy, x = dy.to(device, torch.bfloat16), x.to(device, torch.bfloat16)
    names = K.RULES[rule][1]
    st = {}
    for k in names:
        val = (torch.rand(out_f, in_f, generator=g) * (1e-3 if k == "exp_avg_sq" else 0.1)).to(device)
        val[:8] = 0
        if state == "8bit":
            st[k], st[k + ".scale"] = K.quantize_8bit(val.sqrt() if k == "exp_avg_sq" else val,
                                                      positive=k == "exp_avg_sq")
        else:
            st[k] = val.to(torch.bfloat16)
    hp = _hp(rule)
    w1, st1 = w.clone(), {k: v.clone() for k, v in st.items()}
    w2, st2 = w.clone(), {k: v.clone() for k, v in st.items()}
    K.linear_weight_step(rule, dy, x, w1, st1, hp, step, None, rows_per_tile=16, stochastic_rounding=stochastic,
                         seed=1234 + step)
    (impl or T.linear_weight_step)(rule, dy, x, w2, st2, hp, step, None, stochastic_rounding=stochastic,
                                   seed=1234 + step)
    assert not torch.equal(w1, w), "the update did nothing"
    fractions = []

    def compare(a: torch.Tensor, b: torch.Tensor, step_size: torch.Tensor, what: str) -> None:
        diff = (a.float() - b.float()).abs()
        assert (diff <= step_size * 1.0001).all(), (what, (diff / step_size).max().item())
        fractions.append((diff > 0).float().mean().item())

    compare(w1, w2, torch.finfo(torch.bfloat16).eps * w1.float().abs().clamp_min(1e-30) * 2, "weights")
    for k in names:
        if state == "8bit":
            s1, s2 = st1[k + ".scale"], st2[k + ".scale"]
            rel = ((s1 - s2).abs() / s1.abs()).max().item()
            if rel > 1e-6:  # report what differs (on a GPU) rather than stop the remaining checks
                i = int(((s1 - s2).abs() / s1.abs()).flatten().argmax())
                print(f"FAIL {rule} {state} {k} scales differ: max rel {rel:.2e} at block {i}: "
                      f"{s1.flatten()[i].item()!r} vs {s2.flatten()[i].item()!r}")
                return 1.0
            # scales may differ in their last bit (the block's largest |m| does); count differing codes
            c1, c2 = (S.decode(c, positive=k == "exp_avg_sq") for c in (st1[k], st2[k]))
            compare(c1, c2, _code_step(c1, k), k)
            if k == "exp_avg_sq":  # rows without a gradient stay exactly 0 (a floor would hold their updates back)
                assert not c1[:8].any() and not c2[:8].any(), (rule, k, c1[:8].abs().max(), c2[:8].abs().max())
        else:
            compare(st1[k], st2[k], torch.finfo(torch.bfloat16).eps * st1[k].float().abs().clamp_min(1e-30) * 2, k)
    worst = max(fractions)
    print(f"{rule} {state} state, {'stochastic' if stochastic else 'nearest'} weights, step={step}: "
          f"{worst:.2%} of values differ by one rounding step, none by more")
    return worst


def check_update(rule: str, case: str, device: str = "cpu") -> float:
    """The update kernel for given gradients (norms, biases, embedding and head blocks) against the torch twin:
    a 1-D fp32 gain, a bf16 row block with bf16 state and stochastic rounding (at an element offset, clipped), and an
    8-bit-state matrix. Returns the worst relative error of fp32 values / fraction of rounded values that differ
    (raising if any rounded value is more than one step away), and checks the norm."""
    g = torch.Generator().manual_seed(len(case) + len(rule))
    hp = _hp(rule)
    names = K.RULES[rule][1]
    kw: dict = {}
    if case == "gain":  # 1-D, fp32 everything, 300 elements (partial tiles)
        p = torch.randn(300, generator=g)
        grad = torch.randn(300, generator=g)
        st = {k: torch.rand(300, generator=g) * 0.1 for k in names}
    elif case == "bf16_block":  # rows 40..72 of a bf16 matrix, bf16 state, stochastic rounding, clipped
        p = torch.randn(32, 136, generator=g).bfloat16()
        grad = (torch.randint(-8, 8, (32, 136), generator=g) / 4).bfloat16()
        st = {k: (torch.rand(32, 136, generator=g) * 1e-2).bfloat16() for k in names}
        kw = dict(stochastic_rounding=True, seed=99, offset=40 * 136, coef=0.5)
    else:  # 8-bit state, fp32 matrix
        p = torch.randn(80, 136, generator=g)
        grad = torch.randint(-8, 8, (80, 136), generator=g) / 4
        st = {}
        for k in names:
            val = torch.rand(80, 136, generator=g) * 1e-2
            st[k], st[k + ".scale"] = K.quantize_8bit(val.sqrt() if k == "exp_avg_sq" else val,
                                                      positive=k == "exp_avg_sq")
        kw = dict(seed=5)
    p, grad = p.to(device), grad.to(device)
    st = {k: v.to(device) for k, v in st.items()}
    p1, st1 = p.clone(), {k: v.clone() for k, v in st.items()}
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    n1, b1 = K.update_step(rule, p1, grad, st1, hp, 4, **kw)
    n2, b2 = T.update_step(rule, p2, grad, st2, hp, 4, **kw)
    assert int(b1) == int(b2) == 0 and not torch.equal(p1, p)
    assert abs(n1.item() - n2.item()) <= 1e-5 * n1.item(), (n1.item(), n2.item())
    worst = 0.0
    pairs = [("p", p1, p2)] + [(k, st1[k], st2[k]) for k in names]
    for k, a, b in pairs:
        if a.dtype == torch.float32:
            err = ((a - b).abs().max() / a.abs().max()).item()
            worst = max(worst, err if err == err else float("inf"))  # (a NaN fails: max() would pass it over)
            continue
        if a.dtype == K.Q_DTYPE:  # codes (the scales may differ in their last bit): one code step apart at most
            a, b = (S.decode(c, positive=k == "exp_avg_sq") for c in (a, b))
            step_size = _code_step(a, k)
        else:
            step_size = torch.finfo(torch.bfloat16).eps * 2 * a.float().abs()
        diff = (a.float() - b.float()).abs()
        assert (diff <= step_size * 1.0001 + 1e-30).all(), (rule, case)
        worst = max(worst, (diff > 0).float().mean().item())
    print(f"update {rule} {case}: worst {worst:.2e}")
    return worst


@triton.jit
def _codes_kernel(y_ptr, noise_ptr, codes_ptr, out_ptr, n, SR: tl.constexpr, POSITIVE: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Encode ``y`` and decode ``codes`` with the kernel's 8-bit state code functions (out: uint8 codes, fp32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    noise = tl.load(noise_ptr + offs, mask=mask, other=0)
    tl.store(codes_ptr + offs, T._code_encode(y, noise, SR, POSITIVE), mask=mask)
    tl.store(out_ptr + offs, T._code_decode(tl.load(codes_ptr + offs, mask=mask, other=0), POSITIVE), mask=mask)


def check_codes(device: str = "cpu") -> bool:
    """The kernel's code functions against :mod:`state_codes`, code for code: every code decoded, and values over 16
    binades (both signs, zeros, -0.0, the clamp past q_max, ties) encoded to nearest and stochastically."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(4096, generator=g) * 2.0 ** torch.randint(-16, 2, (4096,), generator=g).float()
    y[:8] = torch.tensor([0.0, -0.0, 1.9375, 1.96875, 5.0, -5.0, 2.0**-10, 1.5 * 2.0**-10])
    y[8:264] = S.decode(torch.arange(256), False) * 1.0  # every signed code's value: exact round trips
    noise = torch.randint(0, 1 << S.NOISE_BITS, (4096,), generator=g, dtype=torch.int32)
    ok = True
    for positive in (False, True):
        for sr in (False, True):
            x = (y.abs() if positive else y).to(device)
            want = S.encode(x.cpu(), noise if sr else None, positive)
            codes = torch.arange(4096, device=device).remainder(256).to(torch.uint8)
            out = torch.empty(4096, device=device)
            _codes_kernel[(4,)](x, noise.to(device), codes, out, 4096, sr, positive, BLOCK=1024)
            same = torch.equal(codes.cpu(), want)
            exact = torch.equal(out.cpu(), S.decode(want, positive))
            print(f"codes {'positive' if positive else 'signed'} {'stochastic' if sr else 'nearest'}: "
                  f"{'equal' if same else 'DIFFER'} codes, {'exact' if exact else 'WRONG'} decode")
            ok &= same and exact
    return ok


def check_fp16_weights(device: str = "cpu") -> float:
    """fp16 weights (bf16 state, as ``state_dtype=auto`` keeps it for them; none for plain SGD, whose kernels take
    the weight as a placeholder state pointer) through the fused, split, update and grouped launches against the
    twin. Returns the fraction of weights that differ, raising if one is more than one fp16 step away."""
    worst = 0.0
    for rule in K.KERNEL_RULES:
        g = torch.Generator().manual_seed(11)
        names, hp = K.RULES[rule][1], _hp(rule)
        dy, x = (torch.randn(6, n, generator=g).half().to(device) for n in (40, 70))
        w0 = torch.randn(40, 70, generator=g).half().to(device)
        st0 = {k: (torch.rand(40, 70, generator=g) * 1e-2).bfloat16().to(device) for k in names}
        grad = (dy.t().float() @ x.float()).half()
        runs = {
            "fused": (T.linear_weight_step, K.linear_weight_step, (dy, x)),
            "split": (T.linear_weight_step_split, K.linear_weight_step, (dy, x)),
            "update": (T.update_step, K.update_step, (grad,)),
            "grouped": (lambda r, p, gr, st, h, s: T.update_many(r, [(p, gr, st, h, s, 0, 0)]), K.update_step,
                        (grad,)),
        }
        for name, (ours, twin, inputs) in runs.items():
            w1, w2 = w0.clone(), w0.clone()
            st1, st2 = ({k: v.clone() for k, v in st0.items()} for _ in range(2))
            if name in ("fused", "split"):
                ours(rule, *inputs, w1, st1, hp, 3)
                twin(rule, *inputs, w2, st2, hp, 3)
            else:
                ours(rule, w1, *inputs, st1, hp, 3)
                twin(rule, w2, *inputs, st2, hp, 3)
            diff = (w1.float() - w2.float()).abs()
            assert not torch.equal(w1, w0), (rule, name)
            assert (diff <= torch.finfo(torch.float16).eps * w2.float().abs() * 1.0001 + 1e-7).all(), (rule, name)
            worst = max(worst, (diff > 0).float().mean().item())
    print(f"fp16 weights (every rule; fused, split, update, grouped): {worst:.2e} of weights one step apart")
    return worst


def check_direct_launch(device: str = "cpu") -> bool:
    """Compiled: a launch that skips Triton's binding (``triton_launch``, a variant launched before) writes the same
    weights and state, bit for bit, as one through ``kernel[grid]`` (``MEMGRAD_TRITON_LAUNCH=jit``). Under the
    interpreter every launch goes through Triton: nothing to compare."""
    from memgrad_hf.kernels import triton_launch as L

    if device == "cpu":
        print("direct launches: none under the interpreter")
        return True
    ok, before = True, T._launch_linear.direct
    for rule, act, state, offset in (("adamw", torch.float32, "fp32", 0), ("lion", torch.bfloat16, "8bit", 0),
                                     ("adamw", torch.bfloat16, "bf16", 1)):
        g = torch.Generator().manual_seed(5)
        dy = torch.randn(33, 64, generator=g).to(device, act)
        x = torch.randn(33 * 128 + offset, generator=g).to(device, act)[offset:].view(33, 128)  # (offset: misaligned)
        w0 = torch.randn(64, 128, generator=g).to(device, act)
        st0 = {k: torch.rand(64, 128, generator=g).to(device) * 1e-2 for k in K.RULES[rule][1]}
        if state == "8bit":
            st0 = {k2: v2 for k, v in st0.items()
                   for k2, v2 in zip((k, k + ".scale"), K.quantize_8bit(v, positive=k == "exp_avg_sq"), strict=True)}
        elif state == "bf16":
            st0 = {k: v.bfloat16() for k, v in st0.items()}
        outs = []
        for enabled in (False, True, True):  # Triton's binding; then the launcher, twice (the second launches directly)
            L.ENABLED, saved = enabled, L.ENABLED
            w, st = w0.clone(), {k: v.clone() for k, v in st0.items()}
            T.linear_weight_step(rule, dy, x, w, st, _hp(rule), 3, stochastic_rounding=True, seed=9)
            L.ENABLED = saved
            outs.append((w, st))
        same = all(torch.equal(outs[0][0], o[0]) and all(torch.equal(outs[0][1][k], o[1][k]) for k in st0)
                   for o in outs[1:])
        ok &= same
        print(f"direct launch {rule} {str(act)[6:]} activations, {state} state, offset {offset}: "
              f"{'bit-identical' if same else 'DIFFERENT'}")
    direct = T._launch_linear.direct - before
    print(f"direct launches: {direct}")
    return ok and direct >= 3


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    rules = K.KERNEL_RULES
    results = [check(rule, acc, step, dev) for rule in rules for acc in (False, True) for step in (1, 7)]
    worst = max(r[0] for r in results)
    bf16_ok = max(check_bf16(rule, step, dev) for rule in rules for step in (1, 7)) <= 1.0
    bf16_ok &= check_codes(dev)
    # reduced-precision state: nearly all values bit-identical (the same noise hash), the rest one step apart
    bf16_ok &= max(check_lowp_state(rule, state, sr, 3, dev) for rule in ("adamw", "lion", "sgd_momentum")
                   for state in ("bf16", "8bit") for sr in (False, True)) <= 0.01
    bf16_ok &= max(check_update(rule, case, dev) for rule in rules
                   for case in ("gain", "bf16_block", "8bit")) <= 0.01
    bf16_ok &= check_fp16_weights(dev) <= 0.01
    bf16_ok &= check_direct_launch(dev)
    # wider tiles (LINEAR_TILES' bn, which benchmarks.forge_launch --sweep times): the same results; with 8-bit
    # state a tile row then spans two scale blocks (136 columns: the second tile holds a partial block and one past
    # the end of the row)
    saved = {k: dict(v) for k, v in T.LINEAR_TILES.items()}
    try:
        for v in T.LINEAR_TILES.values():
            v.update(bm=32, bn=128)
        worst = max(worst, *(check(rule, True, 7, dev)[0] for rule in ("adamw", "lion")))
        bf16_ok &= check_bf16("adamw", 7, dev) <= 1.0
        bf16_ok &= max(check_lowp_state("adamw", state, True, 3, dev) for state in ("bf16", "8bit")) <= 0.01
    finally:
        for k, v in saved.items():
            T.LINEAR_TILES[k].clear()
            T.LINEAR_TILES[k].update(v)
    # the split kernel (library GEMM tiles, then the update kernel): the same contract, the same tolerances
    split = T.linear_weight_step_split
    split_results = [check(rule, acc, 7, dev, impl=split) for rule in rules for acc in (False, True)]
    worst = max(worst, *(r[0] for r in split_results))
    results += split_results
    bf16_ok &= max(check_bf16(rule, 7, dev, impl=split) for rule in rules) <= 1.0
    bf16_ok &= max(check_lowp_state(rule, state, sr, 3, dev, impl=split) for rule in ("adamw", "lion")
                   for state in ("bf16", "8bit") for sr in (False, True)) <= 0.01
    if dev == "cpu":
        print(f"max relative error {worst:.3e}")
        sys.exit(0 if worst < 1e-5 and bf16_ok else 1)
    ok = bf16_ok and not any(t != t for _, t in results)
    print(f"max relative error vs fp64: kernel {worst:.3e}, twin {max(r[1] for r in results):.3e}")
    sys.exit(0 if ok else 1)
