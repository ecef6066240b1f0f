"""Triton twin of the chunked head's fused cross-entropy (:func:`memgrad_hf.kernels.head.fused_cross_entropy`).

Per chunk of tokens cuBLAS computes the logits ``u = x Wᵀ + b`` in the weight's dtype; then one Triton program per
row reads its row twice — an online max / sum-exp (and the mean logit, for label smoothing), then the gradient — and
writes ``dL/du`` over the logits in place, in the same dtype; cuBLAS forms ``dX`` and ``dW`` from it. Two reads
and one write of a low-precision row replace the torch path's ~10 fp32 passes (what made it 3-7x slower than Liger
and TRL on an H100, benchmarks/RESULTS.md). The epilogue (logit scale, softcap, temperature) is applied on the fly.

The recompute schedule (per-token statistics in forward, gradients in backward: log-probs, entropies, GRPO) runs
on two more row kernels: :func:`head_stats` (one online pass over column splits of each row: ``lse``, target logit,
entropy, mean logit, ``Σp²``, target-is-top-1 — all that TRL's trainers ask of a fused head) and
:func:`head_backward` (``dL/du`` from the per-token coefficients, in place). Low-precision weights with the fp32
accumulator walk the vocabulary in blocks (:func:`head_backward_vocab_blocks`, which also hands each block's
weight gradient to FORGE), as the torch path does, so no fp32 ``[V x H]`` buffer exists.

Tested against the torch twin under ``TRITON_INTERPRET=1`` (``tests/_head_triton_check.py``) and compiled on an
H100; the default on CUDA (``MEMGRAD_BACKEND=torch`` selects the torch path), measured 2.0-2.7x faster than it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from memgrad_hf.kernels.head import (  # noqa: F401  (the torch path's other schedules, served as they are)
    Epilogue,
    Stats,
    _dw_buffer,
    _mm_f32,
    aligned_block,
    default_chunk_size,
    grads_from_blocks,
)
from memgrad_hf.kernels.triton_common import round_bf16

PREFERS_FUSED = True  # functional.linear_cross_entropy: gradients in the forward pass by default with this backend
LOGITS_IN_WEIGHT_DTYPE = True  # ... and its chunks sized by the weight's element size (default_chunk_size)
_GRAD_BLOCK = 1024  # columns per program of the gradient kernel


@triton.jit
def _tanh(x):
    """tanh in fp32 to ~4e-7 relative, the same code compiled and interpreted (the interpreter has no libdevice
    tanh): a Taylor series below |x| = 0.1, where ``1 - exp(-2|x|)`` would cancel, the exp form above."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    r = tl.where(ax < 0.1, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -r, r)


@triton.jit
def _epilogue(u, inp, out, TANH: tl.constexpr):
    if TANH:
        return out * _tanh(u * inp)
    return u * inp


@triton.jit
def _online_stats(base, c0, c1, t, inp, out, TANH: tl.constexpr, ENTROPY: tl.constexpr, ZMEAN: tl.constexpr,
                  SUMSQ: tl.constexpr, TOP1: tl.constexpr, BLOCK: tl.constexpr):
    """One online pass over columns ``[c0, c1)`` (``c0 < c1``) of a row of logits: ``(m, Σe, Σe·(z - m), Σz, Σe²,
    max z before column t)`` with ``e = exp(z - m)``; the last four 0 / -inf unless asked for. ``Σe·(z - m)`` (<= 0),
    not ``Σe·z``: the entropy ``log Σe - Σe·(z - m) / Σe`` then never subtracts two numbers of the logits' size."""
    cols0 = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    sz = tl.zeros((), tl.float32)
    zsum = tl.zeros((), tl.float32)
    sq = tl.zeros((), tl.float32)
    mb = tl.full((), float("-inf"), tl.float32)
    for v0 in range(c0, c1, BLOCK):
        cols = v0 + cols0
        ok = cols < c1
        z = _epilogue(tl.load(base + cols, mask=ok, other=0.0).to(tl.float32), inp, out, TANH)
        zm = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(zm, 0))
        # a block of -inf logits so far (a masked vocabulary through the bias) has no finite maximum: rebased on 0
        # there, its e and Σe are 0 and m stays -inf (the split's partials then weigh nothing)
        base_m = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(m - base_m)
        e = tl.exp(zm - base_m)
        if ENTROPY:  # re-based on the new maximum: Σe·(z - m_new) = scale·(Σe·(z - m) + (m - m_new)·Σe)
            shift = tl.where(s > 0, (m - m_new) * s, 0.0)  # (m = -inf before the first block, where s = 0)
            # (e = 0 where z = -inf: its term is 0, not 0·(-inf))
            sz = (sz + shift) * scale + tl.sum(tl.where(e > 0, e * (z - base_m), 0.0), 0)
        s = s * scale + tl.sum(e, 0)
        if ZMEAN:
            zsum += tl.sum(tl.where(ok, z, 0.0), 0)
        if SUMSQ:
            sq = sq * scale * scale + tl.sum(e * e, 0)
        if TOP1:
            mb = tl.maximum(mb, tl.max(tl.where(cols < t, zm, float("-inf")), 0))
        m = m_new
    return m, s, sz, zsum, sq, mb


@triton.jit
def _row_stats(base, V, inp, out, TANH: tl.constexpr, ENTROPY: tl.constexpr, ZMEAN: tl.constexpr,
               BLOCK: tl.constexpr):
    """One online pass over a whole row of logits: ``(lse, entropy, Σ z)`` (the last two 0 unless asked for)."""
    m, s, sz, zsum, _, _ = _online_stats(base, 0, V, 0, inp, out, TANH, ENTROPY, ZMEAN, False, False, BLOCK)
    return m + tl.log(s), tl.log(s) - sz / s, zsum


@triton.jit
def _write_grad(base, ncols, t, lse, alpha, beta, gamma, delta, inp, out,
                TANH: tl.constexpr, HAS_BETA: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_DELTA: tl.constexpr,
                BLOCK: tl.constexpr):
    """Overwrite a row of logits (``ncols`` columns; ``t`` the target's column in it) with ``dL/du``:
    ``dL/dz_j = p_j (alpha + beta log p_j) + gamma [j == t] + delta`` (``log p_j = z_j - lse``) times
    the epilogue's ``dz/du``."""
    cols0 = tl.arange(0, BLOCK)
    for v0 in range(0, ncols, BLOCK):
        cols = v0 + cols0
        ok = cols < ncols
        z = _epilogue(tl.load(base + cols, mask=ok, other=0.0).to(tl.float32), inp, out, TANH)
        logp = z - lse
        p = tl.exp(logp)
        # (p log p is 0 at p = 0, a -inf logit: not 0·(-inf); a NaN p stays NaN, as the twin's xlogy keeps it)
        g = tl.where(p == 0, 0.0, p * (alpha + beta * logp)) if HAS_BETA else p * alpha
        if HAS_GAMMA:
            g += tl.where(cols == t, gamma, 0.0)
        if HAS_DELTA:
            g += delta
        if TANH:
            th = z / out
            g = g * (inp * out * (1.0 - th * th))
        else:
            g = g * inp
        if base.dtype.element_ty == tl.bfloat16:  # round to nearest, compiled or interpreted alike
            g = round_bf16(g)
        tl.store(base + cols, g.to(base.dtype.element_ty), mask=ok)


@triton.jit
def _ce_rows_kernel(
    u_ptr, s_u, t_ptr, w_ptr, loss_ptr,
    V, eps, zl, inp, out,
    TANH: tl.constexpr, SMOOTH: tl.constexpr, WANT_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """A row's weighted cross-entropy and, if asked, its gradient written over the row."""
    row = tl.program_id(0).to(tl.int64)
    base = u_ptr + row * s_u
    t = tl.load(t_ptr + row)
    wt = tl.load(w_ptr + row)
    lse, _, zsum = _row_stats(base, V, inp, out, TANH, False, SMOOTH, BLOCK)
    zt = _epilogue(tl.load(base + t).to(tl.float32), inp, out, TANH)
    ce = lse - zt
    if SMOOTH:
        ce = (1.0 - eps) * ce + eps * (lse - zsum / V)
    ce = ce + zl * lse * lse
    tl.store(loss_ptr + row, wt * ce)
    if WANT_GRAD:
        _write_grad(base, V, t, lse, wt * (1.0 + 2.0 * zl * lse), 0.0, -(1.0 - eps) * wt, -(eps / V) * wt, inp, out,
                    TANH, False, True, SMOOTH, BLOCK)


def _logits_buffer(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialized ``[rows, cols]`` logits buffer whose row stride is padded to a multiple of 64 elements: the
    GEMMs that write and read it want 16-byte-aligned rows (a vocabulary such as GPT-2's 50257 would otherwise send
    every logits GEMM of a chunk to cuBLAS's slow unaligned kernels); the kernels take the row stride."""
    return torch.empty(rows, -(-cols // 64) * 64, dtype=dtype, device=device)[:, :cols]


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, buf: Tensor) -> Tensor:
    out = buf[: h.shape[0]]
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def fused_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    ep: Epilogue,
    token_weight: Tensor,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_size: int,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    accum_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Same contract as the torch twin :func:`memgrad_hf.kernels.head.fused_cross_entropy`: ``Σ_i w_i · CE_i`` and
    ``(loss, dX, dW, db)``. The logits block and ``dL/du`` live in the weight's dtype (as ``nn.Linear``'s logits
    and autograd's logit gradient do); every row reduction is fp32."""
    n, vocab = hidden.shape[0], weight.shape[0]
    targets = targets.contiguous()  # the kernels read per-row inputs at stride 1 (labels[:, ::2] is a strided view)
    want_grad = need_dx or need_dw or need_db
    dx = torch.empty_like(hidden) if need_dx else None
    # an fp32 accumulator for low-precision weights is zeroed and summed into (tensor-core GEMMs with fp32 output)
    dw = None if not need_dw else (_dw_buffer(weight, n, accum_dtype) if accum_dtype == weight.dtype else
                                   torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device))
    db = torch.zeros(vocab, dtype=accum_dtype, device=weight.device) if need_db else None
    rows_loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    buf = _logits_buffer(min(n, chunk_size), vocab, weight.dtype, hidden.device)
    tw = token_weight.to(torch.float32).contiguous()
    block = min(4096, triton.next_power_of_2(vocab))
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        h = hidden[s:e]
        u = _logits(h, weight, bias, buf)
        _ce_rows_kernel[(e - s,)](
            u, u.stride(0), targets[s:e], tw[s:e], rows_loss[s:e],
            vocab, float(label_smoothing), float(z_loss), float(ep.inp), float(ep.out),
            TANH=ep.tanh, SMOOTH=label_smoothing > 0, WANT_GRAD=want_grad, BLOCK=block, num_warps=8,
        )
        if not want_grad:
            continue
        du = u  # overwritten in place by the kernel
        if dx is not None:
            torch.mm(du, weight, out=dx[s:e]) if dx.dtype == weight.dtype else dx[s:e].copy_(du @ weight)
        if dw is not None:
            if dw.dtype == weight.dtype:
                torch.mm(du.t(), h, out=dw) if s == 0 else dw.addmm_(du.t(), h)
            else:
                _mm_f32(du.t(), h, dw)
        if db is not None:
            db.add_(du.sum(0, dtype=db.dtype))
    return rows_loss.sum(), dx, dw, db


# ------------------------------------------------------------------------------------------ recompute schedule


@triton.jit
def _stats_split_kernel(
    u_ptr, s_u, t_ptr, part_ptr, zt_ptr, V, span,
    inp, out,
    TANH: tl.constexpr, ENTROPY: tl.constexpr, ZMEAN: tl.constexpr, SUMSQ: tl.constexpr, TOP1: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One online pass over columns ``[split·span, (split+1)·span)`` of a row of logits; grid ``(rows, splits)``.
    Writes the split's partial statistics ``(m, Σe, Σe·(z - m), Σz, Σe², max before the target)`` with
    ``e = exp(z - m)`` to ``part[row, split, :]`` (combined by :func:`_combine_splits`), and ``z_t`` from the split
    holding the target. Splitting a row over several programs keeps the GPU busy when a chunk has few rows and many
    columns."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    base = u_ptr + row * s_u
    c0 = sp * span
    c1 = tl.minimum(c0 + span, V)
    t = tl.load(t_ptr + row)
    m, s, sz, zsum, sq, mb = _online_stats(base, c0, c1, t, inp, out, TANH, ENTROPY, ZMEAN, SUMSQ, TOP1, BLOCK)
    pp = part_ptr + (row * tl.num_programs(1) + sp) * 6
    tl.store(pp, m)
    tl.store(pp + 1, s)
    tl.store(pp + 2, sz)
    tl.store(pp + 3, zsum)
    tl.store(pp + 4, sq)
    tl.store(pp + 5, mb)
    if (t >= c0) & (t < c1):
        tl.store(zt_ptr + row, _epilogue(tl.load(base + t).to(tl.float32), inp, out, TANH))


@triton.jit
def _grad_rows_kernel(
    u_ptr, s_u, ncols, col0, t_ptr, lse_ptr, a_ptr, b_ptr, g_ptr, d_ptr,
    inp, out,
    TANH: tl.constexpr, HAS_BETA: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``dL/du`` over one ``BLOCK`` of a row of logits (the row holds vocabulary columns ``col0 .. col0 + ncols``)
    from per-row coefficients. Grid ``(rows, column blocks)``: every block is independent, so a chunk of few rows
    still fills the GPU, and no program walks a mostly masked tail."""
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BLOCK
    beta = tl.load(b_ptr + row) if HAS_BETA else 0.0
    gamma = tl.load(g_ptr + row) if HAS_GAMMA else 0.0
    delta = tl.load(d_ptr + row) if HAS_DELTA else 0.0
    _write_grad(u_ptr + row * s_u + c0, tl.minimum(ncols - c0, BLOCK), tl.load(t_ptr + row) - col0 - c0,
                tl.load(lse_ptr + row), tl.load(a_ptr + row), beta, gamma, delta, inp, out,
                TANH, HAS_BETA, HAS_GAMMA, HAS_DELTA, BLOCK)


_STATS_PROGRAMS = 2048  # programs per stats launch to aim for (a few per SM on current GPUs)


def _stats_split(rows: int, vocab: int) -> tuple[int, int, int]:
    """``(splits, span, BLOCK)`` for the stats kernel: enough column splits per row that a chunk of ``rows`` rows
    launches about ``_STATS_PROGRAMS`` programs, each over a span of whole 128-column groups."""
    splits = max(1, min(triton.cdiv(_STATS_PROGRAMS, max(rows, 1)), triton.cdiv(vocab, 128)))
    span = triton.cdiv(triton.cdiv(vocab, splits), 128) * 128
    return triton.cdiv(vocab, span), span, min(4096, triton.next_power_of_2(span))


def _combine_splits(part: Tensor, vocab: int, zt: Tensor, want: frozenset[str]) -> dict[str, Tensor]:
    """Per-row statistics from the stats kernel's per-split partials ``part [N, splits, 6]`` (once per call)."""
    m = part[..., 0]
    top = m.amax(1)
    w = torch.exp(m - top[:, None])
    s = (part[..., 1] * w).sum(1)
    res = {"lse": top + s.log()}
    if "entropy" in want:  # H = lse - Σ p z = log s - Σ_k w_k (Σe·(z - m_k) + (m_k - top) s_k) / s: no cancellation
        # (a split of -inf logits only has s_k = 0 and m_k = -inf: its term is 0)
        term = torch.where(part[..., 1] > 0, (part[..., 2] + (m - top[:, None]) * part[..., 1]) * w, 0.0)
        res["entropy"] = s.log() - term.sum(1) / s
    if "zmean" in want:
        res["zmean"] = part[..., 3].sum(1) / vocab
    if "sumsq" in want:
        res["sumsq"] = (part[..., 4] * w * w).sum(1) / (s * s)
    if "top1" in want:  # the first argmax: no larger logit anywhere, none as large before the target
        res["top1"] = (zt >= top) & (zt > part[..., 5].amax(1))
    return res


def head_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    ep: Epilogue,
    *,
    chunk_size: int,
    need_entropy: bool = False,
    need_zmean: bool = False,
    need_sumsq: bool = False,
    need_top1: bool = False,
) -> Stats:
    """Same contract as the torch twin :func:`memgrad_hf.kernels.head.head_stats`: per chunk of tokens one logits
    GEMM, then one stats launch over (rows, column splits); the splits are combined once at the end."""
    n, vocab = hidden.shape[0], weight.shape[0]
    targets = targets.contiguous()  # (per-row inputs are read at stride 1)
    flags = {"entropy": need_entropy, "zmean": need_zmean, "sumsq": need_sumsq, "top1": need_top1}
    want = frozenset(k for k, v in flags.items() if v)
    chunk = min(n, chunk_size)
    splits, span, block = _stats_split(chunk, vocab)
    part = torch.empty(n, splits, 6, dtype=torch.float32, device=hidden.device)
    zt = torch.empty(n, dtype=torch.float32, device=hidden.device)
    buf = _logits_buffer(chunk, vocab, weight.dtype, hidden.device)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        u = _logits(hidden[s:e], weight, bias, buf)
        _stats_split_kernel[(e - s, splits)](
            u, u.stride(0), targets[s:e], part[s:e], zt[s:e], vocab, span, float(ep.inp), float(ep.out),
            TANH=ep.tanh, ENTROPY=need_entropy, ZMEAN=need_zmean, SUMSQ=need_sumsq, TOP1=need_top1, BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
    return Stats(target=zt, **_combine_splits(part, vocab, zt, want))


def _grad_rows(u: Tensor, col0: int, targets: Tensor, lse: Tensor, coef: list[Tensor | None], ep: Epilogue) -> None:
    alpha, beta, gamma, delta = (None if c is None else c.to(torch.float32).contiguous() for c in coef)
    targets, lse = targets.contiguous(), lse.contiguous()  # (per-row inputs are read at stride 1)
    block = min(_GRAD_BLOCK, triton.next_power_of_2(u.shape[1]))
    _grad_rows_kernel[(u.shape[0], -(-u.shape[1] // block))](
        u, u.stride(0), u.shape[1], col0, targets, lse, alpha,
        beta if beta is not None else alpha, gamma if gamma is not None else alpha,
        delta if delta is not None else alpha, float(ep.inp), float(ep.out),
        TANH=ep.tanh, HAS_BETA=beta is not None, HAS_GAMMA=gamma is not None, HAS_DELTA=delta is not None,
        BLOCK=block, num_warps=4,
    )


def head_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    lse: Tensor,
    ep: Epilogue,
    alpha: Tensor,
    beta: Tensor | None,
    gamma: Tensor | None,
    delta: Tensor | None,
    *,
    chunk_size: int,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    accum_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Same contract as the torch twin :func:`memgrad_hf.kernels.head.head_backward`: recompute the logits, turn
    them into ``dL/du`` with the row kernel, and form ``(dX, dW, db)`` with GEMMs."""
    n, vocab = hidden.shape[0], weight.shape[0]
    coef = [alpha, beta, gamma, delta]
    if need_dw and weight.dtype != accum_dtype:
        return _backward_low_precision(hidden, weight, bias, targets, lse, ep, coef, need_dx=need_dx,
                                       need_db=need_db, chunk_size=chunk_size)
    dx = torch.empty_like(hidden) if need_dx else None
    dw = _dw_buffer(weight, n, accum_dtype) if need_dw else None
    db = torch.zeros(vocab, dtype=accum_dtype, device=weight.device) if need_db else None
    buf = _logits_buffer(min(n, chunk_size), vocab, weight.dtype, hidden.device)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        h = hidden[s:e]
        du = _logits(h, weight, bias, buf)
        _grad_rows(du, 0, targets[s:e], lse[s:e], [None if c is None else c[s:e] for c in coef], ep)
        if dx is not None:
            torch.mm(du, weight, out=dx[s:e])
        if dw is not None:
            torch.mm(du.t(), h, out=dw) if s == 0 else dw.addmm_(du.t(), h)
        if db is not None:
            db.add_(du.sum(0, dtype=db.dtype))
    return dx, dw, db


def _backward_low_precision(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, lse: Tensor,
                            ep: Epilogue, coef: list[Tensor | None], *, need_dx: bool, need_db: bool,
                            chunk_size: int) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """Low-precision weights, fp32 accumulation: each vocabulary block's ``dW`` is summed over every token in fp32
    and rounded once into the weight's dtype; ``dX`` accumulates in fp32 across blocks (as the torch path). A
    block's logits ``[n x vb]`` in the weight's dtype take about what one token chunk's full row would."""
    return grads_from_blocks(head_backward_vocab_blocks, hidden, weight, bias, targets, lse, ep, coef,
                             need_dx=need_dx, need_db=need_db,
                             block_bytes=chunk_size * weight.shape[0] * weight.element_size(),
                             weight_block_bytes=weight.numel() * 4)


def head_backward_vocab_blocks(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    lse: Tensor,
    ep: Epilogue,
    alpha: Tensor,
    beta: Tensor | None,
    gamma: Tensor | None,
    delta: Tensor | None,
    on_weight_block: Callable[[int, int, Tensor, Tensor | None], None],
    *,
    block_bytes: int | None = None,
    weight_block_bytes: int | None = None,
    need_dx: bool = True,
    need_db: bool = False,
    dw_out: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Same contract as the torch twin :func:`memgrad_hf.kernels.head.head_backward_vocab_blocks`: walk the
    vocabulary in row blocks over every token at once, hand each block's complete weight (and bias) gradient to
    ``on_weight_block(v0, v1, dW_blk, db_blk)`` (in the weight's dtype, summed in fp32 and rounded once), return
    ``(dX, None)``. The logits block and ``dL/du`` live in the weight's dtype (the row kernel writes ``dL/du`` over
    the logits); budgets default to GPU-sized work (None: 128 MiB of logits, 64 MiB of fp32 weight gradient — what
    FORGE takes per tile on a GPU), a block a few large GEMMs rather than many small launches."""
    n, vocab = hidden.shape[0], weight.shape[0]
    block_bytes, weight_block_bytes = block_bytes or (128 << 20), weight_block_bytes or (64 << 20)
    vb = aligned_block(min(vocab, block_bytes // max(weight.element_size() * n, 1),
                           weight_block_bytes // max(4 * hidden.shape[1], 1)))
    lp = weight.dtype != torch.float32
    dx = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_dx else None
    for v0 in range(0, vocab, vb):
        v1 = min(v0 + vb, vocab)
        w_blk = weight[v0:v1]
        b_blk = None if bias is None else bias[v0:v1]
        du = _logits(hidden, w_blk, b_blk, _logits_buffer(n, v1 - v0, weight.dtype, hidden.device))
        # the kernel adds the target term only where the target's column falls inside this block
        _grad_rows(du, v0, targets, lse, [alpha, beta, gamma, delta], ep)
        if dx is not None:
            _mm_f32(du, w_blk, dx) if lp else dx.addmm_(du, w_blk)
        out = None if dw_out is None else dw_out[v0:v1]
        if lp and not du.is_cuda:
            dw_blk = _mm_f32(du.t(), hidden).to(weight.dtype)
            dw_blk = dw_blk if out is None else out.copy_(dw_blk)
        else:  # cuBLAS sums a low-precision GEMM in fp32 and rounds once: autograd's own dW GEMM, no fp32 copy
            dw_blk = torch.mm(du.t(), hidden, out=out)
        db_blk = du.sum(0, dtype=torch.float32).to(bias.dtype) if (need_db and bias is not None) else None
        del du
        on_weight_block(v0, v1, dw_blk, db_blk)
    return (None if dx is None else dx.to(hidden.dtype)), None
