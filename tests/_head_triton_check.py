"""Run under TRITON_INTERPRET=1 (by test_head_triton.py): the Triton fused cross-entropy against its torch twin.

Direct (``kernels.head_triton.fused_cross_entropy`` vs ``kernels.head.fused_cross_entropy``) for fp32 with every
option (label smoothing, z-loss, softcap + logit scale, bias, token weights, one and several vocabulary blocks, a
partial last chunk), then end to end through ``functional.linear_cross_entropy`` with ``MEMGRAD_BACKEND=triton``.
On a GPU machine: ``python tests/_head_triton_check.py cuda`` runs the compiled kernel (and bf16 there).
Prints one line per case and exits non-zero above the tolerance.
"""

import os
import sys

import torch

from memgrad_hf.kernels import head as K
from memgrad_hf.kernels import head_triton as T


def rel(a, b):
    """Largest difference over the reference's largest finite magnitude; equal values (infinities included: a mean
    logit over a masked vocabulary is -inf in both) count 0, and a NaN in either makes it inf (never a pass)."""
    a, b = a.detach().double(), b.detach().double()
    diff = torch.where(a == b, 0.0, (a - b).abs()).nan_to_num(nan=float("inf"))
    scale = b[b.isfinite()].abs().max() if bool(b.isfinite().any()) else b.new_tensor(1.0)
    return (diff.max() / scale.clamp_min(1e-30)).item() if diff.numel() else 0.0


def _masked(b, t, v, masked, g):
    """A bias with ``-inf`` rows (a masked vocabulary): every third row, or all but the last tenth (``range``: whole
    column blocks and stats splits of -inf, the first ones included); targets redrawn from the rows left."""
    if masked is None:
        return b, t
    rows = torch.arange(v)
    off = rows % 3 == 1 if masked == "sparse" else rows < v - v // 10  # (range: the first column blocks all -inf)
    b = b.clone()
    b[off.to(b.device)] = float("-inf")
    keep = rows[~off]
    return b, keep[torch.randint(0, len(keep), t.shape, generator=g)].to(t.device)


def case(dev, dtype, n, h, v, chunk, eps=0.0, zl=0.0, softcap=None, scale=1.0, bias=False, seed=0, masked=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dev, dtype)
    w = (torch.randn(v, h, generator=g) * 0.3).to(dev, dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dev, dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    b, t = _masked(b, t, v, masked, g)
    tw = (torch.rand(n, generator=g) + 0.5).to(dev)
    ep = K.Epilogue.make(logit_scale=scale, softcap=softcap)
    kw = dict(label_smoothing=eps, z_loss=zl, chunk_size=chunk, need_dx=True, need_dw=True, need_db=bias)
    ref = K.fused_cross_entropy(x, w, b, t, ep, tw, **kw)
    out = T.fused_cross_entropy(x, w, b, t, ep, tw, **kw)
    return max(rel(o, r) for o, r in zip(out, ref, strict=True) if r is not None)


def recompute_case(dev, n, h, v, chunk, softcap=None, scale=1.0, bias=False, accum=torch.float32, seed=1,
                   dtype=torch.float32, masked=None):
    """head_stats + head_backward (the log-prob / entropy schedule) with random per-token coefficients; fp32 weights
    with an fp64 accumulator take the vocabulary-block walk of low-precision weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dev, dtype)
    w = (torch.randn(v, h, generator=g) * 0.3).to(dev, dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dev, dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    b, t = _masked(b, t, v, masked, g)
    ep = K.Epilogue.make(logit_scale=scale, softcap=softcap)
    st_r = K.head_stats(x, w, b, t, ep, chunk_size=chunk, need_entropy=True, need_zmean=True)
    st_t = T.head_stats(x, w, b, t, ep, chunk_size=chunk, need_entropy=True, need_zmean=True)
    errs = [rel(getattr(st_t, k), getattr(st_r, k)) for k in ("lse", "target", "entropy", "zmean")]
    coef = [torch.randn(n, generator=g).to(dev) for _ in range(4)]
    kw = dict(chunk_size=chunk, need_dx=True, need_dw=True, need_db=bias, accum_dtype=accum)
    ref = K.head_backward(x, w, b, t, st_r.lse, ep, *coef, **kw)
    out = T.head_backward(x, w, b, t, st_r.lse, ep, *coef, **kw)
    errs += [rel(o, r) for o, r in zip(out, ref, strict=True) if r is not None]
    return max(errs)


def nan_row_case(dev, n=6, h=16, v=700, chunk=4):
    """A NaN in one token's hidden state: its logits, statistics and every gradient it touches are NaN on both
    paths (the entropy term's ``p log p`` guard must not turn a NaN ``p`` into 0: finite, wrong gradients that no
    non-finite check would catch). Returns whether the NaN patterns agree."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, h, generator=g).to(dev)
    x[2, 3] = float("nan")
    w = (torch.randn(v, h, generator=g) * 0.3).to(dev)
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    ep = K.Epilogue.make()
    st = K.head_stats(x, w, None, t, ep, chunk_size=chunk, need_entropy=True)
    coef = [torch.randn(n, generator=g).to(dev) for _ in range(4)]
    kw = dict(chunk_size=chunk, need_dx=True, need_dw=True, need_db=False)
    ref = K.head_backward(x, w, None, t, st.lse, ep, *coef, **kw)
    out = T.head_backward(x, w, None, t, st.lse, ep, *coef, **kw)
    same = all(torch.equal(o.isnan().cpu(), r.isnan().cpu()) for o, r in zip(out, ref, strict=True) if r is not None)
    return same and bool(ref[0][2].isnan().all()) and not bool(ref[0][0].isnan().any())


def diagnostics_case(dev, n, h, v, chunk, dtype=torch.float32, seed=4, programs=None):
    """head_stats with every output TRL's trainers ask for (SFT: entropy + top-1; KTO: mean logit; Σp²). Integer
    inputs make the logits exact integers in any GEMM order, so ties at the maximum are many and the same for both:
    targets are drawn from the first maximum, a later tied maximum, and anywhere. ``programs`` lowers the kernel's
    programs-per-launch aim, so that each program walks several column blocks (its running max rescaled)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, h), generator=g).float()
    w = torch.randint(-2, 3, (v, h), generator=g).float()
    z = x @ w.t()
    ties = (z == z.amax(1, keepdim=True)).float()
    first = ties.argmax(1)
    last = v - 1 - ties.flip(1).argmax(1)
    rand = torch.randint(0, v, (n,), generator=g)
    t = torch.where(torch.arange(n) % 3 == 0, first, torch.where(torch.arange(n) % 3 == 1, last, rand))
    assert bool((last > first).any()), "no tied maximum drawn"
    x, w, t = x.to(dev, dtype), w.to(dev, dtype), t.to(dev)
    ep = K.Epilogue.make(logit_scale=0.25)
    kw = dict(chunk_size=chunk, need_entropy=True, need_zmean=True, need_sumsq=True, need_top1=True)
    default, T._STATS_PROGRAMS = T._STATS_PROGRAMS, programs or T._STATS_PROGRAMS
    try:
        st_r, st_t = K.head_stats(x, w, None, t, ep, **kw), T.head_stats(x, w, None, t, ep, **kw)
    finally:
        T._STATS_PROGRAMS = default
    assert torch.equal(st_t.top1.cpu(), st_r.top1.cpu()), (st_t.top1, st_r.top1)
    assert 0 < int(st_r.top1.sum()) < n
    return max(rel(getattr(st_t, k), getattr(st_r, k)) for k in ("lse", "target", "entropy", "zmean", "sumsq"))


def consumer_case(dev, n, h, v, block_bytes, dtype=torch.float32, seed=2):
    """head_backward_vocab_blocks (FORGE's head): the blocks handed to the consumer and dX, Triton vs torch twin."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dev, dtype)
    w = (torch.randn(v, h, generator=g) * 0.3).to(dev, dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dev, dtype)
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    ep = K.Epilogue.make(logit_scale=0.5, softcap=3.0)
    lse = K.head_stats(x, w, b, t, ep, chunk_size=8).lse
    coef = [torch.randn(n, generator=g).to(dev) for _ in range(4)]
    got = []
    for impl in (K, T):
        dw, db, spans = torch.zeros_like(w), torch.zeros_like(b), []

        def keep(v0, v1, dw_blk, db_blk, dw=dw, db=db, spans=spans):
            dw[v0:v1], db[v0:v1] = dw_blk, db_blk
            spans.append((v0, v1))

        dx, _ = impl.head_backward_vocab_blocks(x, w, b, t, lse, ep, *coef, keep, block_bytes=block_bytes,
                                                weight_block_bytes=block_bytes, need_db=True)
        assert spans[0][0] == 0 and spans[-1][1] == v and len(spans) > 2, spans
        assert all(a[1] == c[0] for a, c in zip(spans, spans[1:], strict=False))
        got.append((dx, dw, db))
    return max(rel(o, r) for o, r in zip(got[1], got[0], strict=True))


def end_to_end(dev):
    from memgrad_hf.functional import linear_cross_entropy

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 16, generator=g).to(dev).requires_grad_()
    w = torch.randn(200, 16, generator=g).to(dev).requires_grad_()
    y = torch.randint(0, 200, (2, 9), generator=g).to(dev)
    y[0, :3] = -100
    res = []
    for backend in ("torch", "triton"):
        os.environ["MEMGRAD_BACKEND"] = backend
        loss = linear_cross_entropy(x, w, y, label_smoothing=0.1, softcap=5.0)
        res.append((loss, *torch.autograd.grad(loss, (x, w))))
    os.environ.pop("MEMGRAD_BACKEND")
    err = max(rel(a, b) for a, b in zip(res[1], res[0], strict=True))
    from memgrad_hf.functional import linear_logprobs

    ids = y.clamp_min(0)
    res = []
    for backend in ("torch", "triton"):
        os.environ["MEMGRAD_BACKEND"] = backend
        diag = {}
        lp, ent = linear_logprobs(x, w, ids, temperature=0.7, return_entropy=True, diagnostics=diag)
        res.append((lp, ent, diag["mean_logits"], diag["log_sum_sq_probs"], diag["is_top1"],
                    *torch.autograd.grad((lp * 0.3).sum() + ent.sum(), (x, w))))
    os.environ.pop("MEMGRAD_BACKEND")
    err = max(err, max(rel(a, b) for a, b in zip(res[1], res[0], strict=True)))
    # strided targets (labels[:, ::2] of one row): the kernels read per-row inputs at stride 1 and read other ids
    x1, y1 = x[0].detach().requires_grad_(), torch.randint(0, 200, (18,), generator=g).to(dev)[::2]
    res = []
    for backend in ("torch", "triton"):
        os.environ["MEMGRAD_BACKEND"] = backend
        loss = linear_cross_entropy(x1, w, y1) + linear_logprobs(x1, w, y1, return_entropy=True)[1].sum()
        res.append((loss, *torch.autograd.grad(loss, (x1, w))))
    os.environ.pop("MEMGRAD_BACKEND")
    err = max(err, max(rel(a, b) for a, b in zip(res[1], res[0], strict=True)))
    # several token chunks, the Triton forward's (backward chunk + hidden: 384 tokens) larger than its backward's
    # (256): both walks must cover every token once
    x = torch.randn(600, 128, generator=g).to(dev).requires_grad_()
    w = (torch.randn(1000, 128, generator=g) * 0.1).to(dev).requires_grad_()
    ids = torch.randint(0, 1000, (600,), generator=g).to(dev)
    res = []
    for backend in ("torch", "triton"):
        os.environ["MEMGRAD_BACKEND"] = backend
        lp, ent = linear_logprobs(x, w, ids, return_entropy=True)
        res.append((lp, ent, *torch.autograd.grad((lp * 0.3).sum() + ent.sum(), (x, w))))
    os.environ.pop("MEMGRAD_BACKEND")
    from memgrad_hf.functional import _stats_chunks
    from memgrad_hf.kernels import head_triton

    assert head_triton.LOGITS_IN_WEIGHT_DTYPE
    os.environ["MEMGRAD_BACKEND"] = "triton"
    chunks = _stats_chunks(None, 600, x, w)
    os.environ.pop("MEMGRAD_BACKEND")
    assert chunks == (384, 256), chunks
    return max(err, max(rel(a, b) for a, b in zip(res[1], res[0], strict=True)))


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    cases = {
        "plain, one block": dict(n=37, h=24, v=300, chunk=16),
        "plain, several blocks": dict(n=20, h=16, v=9000, chunk=8),
        "label smoothing + z-loss": dict(n=21, h=16, v=500, chunk=8, eps=0.1, zl=1e-3),
        "softcap + logit scale + bias": dict(n=19, h=16, v=700, chunk=32, softcap=3.0, scale=0.5, bias=True),
    }
    worst = 0.0
    for name, kw in cases.items():
        err = case(dev, torch.float32, **kw)
        worst = max(worst, err)
        print(f"fp32 {name}: max rel err {err:.2e}")
    rcases = {
        "plain": dict(n=23, h=16, v=300, chunk=8),
        "softcap + scale + bias, several blocks": dict(n=17, h=16, v=9000, chunk=8, softcap=3.0, scale=0.5, bias=True),
        "vocabulary-block walk (fp64 accumulator)": dict(n=19, h=16, v=700, chunk=8, bias=True, accum=torch.float64),
    }
    for name, kw in rcases.items():
        err = recompute_case(dev, **kw)
        worst = max(worst, err)
        print(f"fp32 stats + backward, {name}: max rel err {err:.2e}")
    # -inf logits (a masked vocabulary through the bias): 0·(-inf) terms are 0, as the twin's xlogy makes them; a
    # whole block or stats split of -inf has no finite maximum to rebase on
    for masked in ("sparse", "range"):
        err = max(case(dev, torch.float32, n=19, h=16, v=9000, chunk=8, eps=0.1, zl=1e-3, bias=True, masked=masked),
                  recompute_case(dev, n=17, h=16, v=9000, chunk=8, bias=True, masked=masked),
                  recompute_case(dev, n=19, h=16, v=700, chunk=8, bias=True, accum=torch.float64, masked=masked))
        worst = max(worst, err)
        print(f"fp32 -inf bias rows ({masked}), fused and stats + backward: max rel err {err:.2e}")
    nan_ok = nan_row_case(dev)
    print(f"fp32 a NaN hidden row, stats + backward with the entropy term: NaN where the twin's NaN is: {nan_ok}")
    assert nan_ok, "the Triton head backward hid a NaN row's gradient"
    for name, kw in {"one split per row": dict(n=300, h=16, v=200, chunk=300),
                     "several splits per row": dict(n=23, h=16, v=1000, chunk=8),
                     "several column blocks per program": dict(n=20, h=16, v=9000, chunk=8, programs=16)}.items():
        err = diagnostics_case(dev, **kw)
        worst = max(worst, err)
        print(f"fp32 stats with entropy, mean logit, sum p^2, top-1 (ties), {name}: max rel err {err:.2e}")
    err = consumer_case(dev, n=21, h=16, v=1000, block_bytes=8 * 21 * 16)
    worst = max(worst, err)
    print(f"fp32 weight-gradient blocks to a consumer (FORGE's head): max rel err {err:.2e}")
    err = end_to_end(dev)
    worst = max(worst, err)
    if dev == "cpu":  # (the fp64 reference runs on the CPU)
        from tests.helpers import entropy_grad_errors

        os.environ["MEMGRAD_BACKEND"] = "triton"
        ours, fp32 = entropy_grad_errors()
        os.environ.pop("MEMGRAD_BACKEND")
        print(f"entropy gradient at logits of std ~40 vs fp64: Triton {ours:.2e}, fp32 autograd {fp32:.2e}")
        assert ours <= 2.0 * fp32, (ours, fp32)
    print(f"linear_cross_entropy + linear_logprobs, MEMGRAD_BACKEND=triton vs torch: max rel err {err:.2e}")
    from memgrad_hf import kernels

    kernels.smoke.head(dev)  # what decides, once per process, whether the default Triton head is used
    print("default-head smoke test: passed")
    # bf16 weights: the logits come from the same torch GEMM and both round dL/du to nearest bf16 (the kernel by bit
    # arithmetic: the interpreter's own cast truncates), so interpreted they agree to fp32 rounding
    bf16 = max(case(dev, torch.bfloat16, n=40, h=32, v=1000, chunk=8, eps=0.1),
               recompute_case(dev, n=50, h=32, v=1000, chunk=8, dtype=torch.bfloat16),
               consumer_case(dev, n=40, h=32, v=1000, block_bytes=8 * 40 * 32, dtype=torch.bfloat16),
               diagnostics_case(dev, n=30, h=16, v=1000, chunk=8, dtype=torch.bfloat16))
    print(f"bf16 fused, recompute and consumer schedules: max rel err {bf16:.2e}")
    worst = max(worst, bf16) if dev == "cpu" else worst
    ok = worst < 1e-5
    if dev != "cpu":  # compiled: the exps differ in their last bits, so a bf16 rounding may fall the other way
        err = case(dev, torch.bfloat16, n=512, h=256, v=32768, chunk=256, eps=0.1)
        print(f"bf16 (8192-column blocks): max rel err {err:.2e}")
        # the GRPO schedule on bf16 weights: fp32-accumulated vocabulary blocks (4194 rows, aligned down to 4096)
        err2 = recompute_case(dev, n=500, h=256, v=32768, chunk=64, dtype=torch.bfloat16)
        print(f"bf16 stats + backward, vocabulary-block walk: max rel err {err2:.2e}")
        err3 = consumer_case(dev, n=512, h=256, v=32768, block_bytes=4 << 20, dtype=torch.bfloat16)
        print(f"bf16 weight-gradient blocks to a consumer: max rel err {err3:.2e}")
        err2 = max(err2, recompute_case(dev, n=500, h=256, v=50257, chunk=64, dtype=torch.bfloat16))  # odd vocab
        print(f"bf16 stats + backward, also at GPT-2's 50257 columns (row-padded logits): max rel err {err2:.2e}")
        err4 = diagnostics_case(dev, n=4096, h=64, v=151936, chunk=256, dtype=torch.bfloat16)
        print(f"bf16 stats with every diagnostic, 151936 columns (exact integer logits): max rel err {err4:.2e}")
        ok = ok and err < 2e-2 and err2 < 2e-2 and err3 < 2e-2 and err4 < 1e-5
    print(f"max relative error {worst:.3e}")
    sys.exit(0 if ok else 1)
