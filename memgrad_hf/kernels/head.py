"""Chunked LM-head math, torch path: loss, log-probs and entropies of ``z = f(x Wᵀ + b)`` without ever
holding more than one ``[chunk x vocab]`` block of logits.

Every objective the head serves has a per-token gradient of one shape::

    dL/dz_j = p_j * (alpha + beta * log p_j) + gamma * 1[j == t] + delta

(cross-entropy, label smoothing, z-loss, log-prob and entropy all fit; ``log p_j = z_j - lse``, so the entropy's
``beta`` term never meets ``lse`` itself: with logits in the hundreds, ``alpha + beta·lse`` would cancel digits), so
one chunk routine, :func:`_grad_from_probs`, produces every gradient from four per-token coefficients. Two
schedules use it:

* :func:`fused_cross_entropy` — gradients computed in the forward pass (6·N·V·D flops, no recompute); used for
  scalar losses, where the upstream gradient is a single number applied in backward.
* :func:`head_stats` + :func:`head_backward` — forward keeps only per-token statistics; backward recomputes the
  logits chunk by chunk (8·N·V·D flops); used where per-token upstream gradients exist (log-probs, entropies,
  ``reduction="none"``).

Nothing here knows about transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Epilogue:
    """Element-wise map applied to ``u = x Wᵀ + b``: ``z = out * tanh(inp * u)`` if ``tanh`` else ``z = inp * u``.

    Covers logit scales/multipliers, final-logit softcapping and sampling temperature in one form.
    """

    inp: float = 1.0
    tanh: bool = False
    out: float = 1.0

    @staticmethod
    def make(logit_scale: float = 1.0, softcap: float | None = None, temperature: float = 1.0) -> Epilogue:
        """``z = softcap * tanh(logit_scale * u / softcap) / temperature`` (no tanh when ``softcap`` is None)."""
        if softcap is not None and softcap > 0:
            return Epilogue(inp=logit_scale / softcap, tanh=True, out=softcap / temperature)
        return Epilogue(inp=logit_scale / temperature)

    @property
    def identity(self) -> bool:
        return not self.tanh and self.inp == 1.0


def apply_epilogue_(u: Tensor, ep: Epilogue) -> Tensor:
    """In place on an fp32 ``u``; returns it."""
    if ep.inp != 1.0:
        u.mul_(ep.inp)
    if ep.tanh:
        u.tanh_()
        if ep.out != 1.0:
            u.mul_(ep.out)
    return u


_LOGIT_COLS = 2048  # vocabulary columns per logits GEMM call (see _chunk_logits)
_DX_ROWS = 4096  # vocabulary rows per dX GEMM call (see _accumulate)
# A CPU GEMM with fewer output rows than _FEW_ROWS may run a BLAS small-matrix path that adds the whole contraction
# into one running sum (MKL: 1-11 rows, not a multiple of 4). Over a vocabulary, where the target's term dwarfs the
# others, that costs ~2e-5 relative in dX at 200k words (measured; ~1e-6 for a larger call, as HF's one GEMM over all
# tokens): such calls sum fresh products of _PARTIAL_K-long slices instead (see _mm_long_)
_FEW_ROWS, _PARTIAL_K = 16, 1024


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype the head's softmax statistics and gradients are formed in: fp32, or fp64 for an fp64 weight (an
    fp64 model, ``torch.autograd.gradcheck``) so that its numbers are not rounded to fp32."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def full_precision(weight: Tensor) -> bool:
    """The weight is in :func:`compute_dtype` (fp32 or fp64): its GEMMs need no upcast copies."""
    return weight.dtype in (torch.float32, torch.float64)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, ep: Epilogue, buf: Tensor | None,
                  row_max: Tensor | None = None) -> Tensor:
    """fp32 logits ``[c, V]`` of one chunk. The matmul runs in the weight's dtype (as ``nn.Linear`` does) so
    results match the unpatched model; fp32 weights write straight into the reusable buffer.

    ``row_max`` (``[c]`` fp32) receives each row's largest logit, read from each column block while it is still in
    cache (no separate pass over the chunk)."""
    c = h.shape[0]
    if buf is not None and buf.dtype == weight.dtype:
        out = _chunk_view(buf, c, weight.shape[0])
        if row_max is not None:
            row_max.fill_(-math.inf)
        # In column blocks: MKL keeps a packing buffer that grows with the output width for the life of the process
        # (32 MiB at 32k columns, 9 MiB at 4k, 6 MiB at 2k), at no cost in speed. Each logit is the same dot
        # product: exact.
        for v0 in range(0, weight.shape[0], _LOGIT_COLS):
            v1 = min(v0 + _LOGIT_COLS, weight.shape[0])
            blk = out[:, v0:v1]
            if bias is None:
                torch.mm(h, weight[v0:v1].t(), out=blk)
            else:
                torch.addmm(bias[v0:v1], h, weight[v0:v1].t(), out=blk)
            apply_epilogue_(blk, ep)
            if row_max is not None:
                torch.maximum(row_max, blk.amax(1), out=row_max)
        return out
    u = torch.nn.functional.linear(h, weight, bias)
    if buf is not None:
        out = _chunk_view(buf, c, weight.shape[0])
        out.copy_(u)
    else:
        out = u.to(compute_dtype(weight))
    del u
    apply_epilogue_(out, ep)
    if row_max is not None:
        torch.amax(out, 1, out=row_max)
    return out


def _exp_shifted_(z: Tensor, shift: Tensor, want_sum: bool = False) -> Tensor | None:
    """``z <- exp(z - shift)`` row-wise, in place, one column block at a time so that each block is read from
    memory once for all three ops (a softmax along the strided dimension of a vocabulary-major chunk walks memory
    ~3x slower); returns each row's sum when ``want_sum``.

    With ``shift`` the row max this is the softmax numerator, ``p = e / sum`` and ``lse = max + log(sum)``
    (exact: ``sum`` lies in ``[1, V]``); with ``shift = lse`` it is ``p`` itself."""
    total = torch.zeros_like(shift) if want_sum else None
    step = z.shape[1] if z.is_cuda else _LOGIT_COLS  # on a GPU each block would be three more launches
    for v0 in range(0, z.shape[1], step):
        blk = z[:, v0:v0 + step]
        blk.sub_(shift[:, None]).exp_()
        if total is not None:
            total += blk.sum(1)
    return total


def _mm_long_(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """``out = a @ b`` (``accumulate``: ``out += a @ b``) in ``out``'s dtype, for a long contraction (the
    vocabulary). A CPU call with few rows sums fresh products of slices (see ``_FEW_ROWS``): as accurate as a large
    call whatever the BLAS library's small-matrix path does."""
    if a.is_cuda or a.shape[0] >= _FEW_ROWS or a.shape[1] <= _PARTIAL_K:
        out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
        return
    part = torch.empty_like(out)
    for k0 in range(0, a.shape[1], _PARTIAL_K):
        first = k0 == 0 and not accumulate
        torch.mm(a[:, k0:k0 + _PARTIAL_K], b[k0:k0 + _PARTIAL_K], out=out if first else part)
        if not first:
            out.add_(part)


def _mm_f32(a: Tensor, b: Tensor, acc: Tensor | None = None) -> Tensor:
    """``a @ b`` (``+ acc``) accumulated and returned in fp32, for low-precision ``a``, ``b``: the exact products of
    the rounded operands, as autograd's own GEMM computes them. On CUDA one tensor-core GEMM with fp32 output (no
    upcast copies, no fp32 GEMM); elsewhere fp32 copies of the operands."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    if acc is None:
        return a.float() @ b.float()
    return acc.addmm_(a.float(), b.float())


@dataclass
class Stats:
    """Per-token statistics of the logits ``z`` (all fp32, shape ``[N]``)."""

    lse: Tensor  # log Σ_j exp z_j
    target: Tensor  # z_t (0 where the target is ignored)
    entropy: Tensor | None = None  # H = lse - Σ_j p_j z_j
    zmean: Tensor | None = None  # mean_j z_j (label smoothing)
    sumsq: Tensor | None = None  # Σ_j p_j²
    top1: Tensor | None = None  # the target is the (first) argmax


def _stats_of_chunk(z: Tensor, zmax: Tensor, t: Tensor, want: frozenset[str]) -> dict[str, Tensor]:
    """Consumes ``z`` (overwritten); ``zmax`` is its row maximum. ``t`` holds valid indices only. ``want`` ⊆
    {entropy, zmean, sumsq, top1}.

    From ``e = exp(z - max)`` and ``s = Σ e`` (so ``p = e / s``): ``lse = max + log s``, ``Σ p² = Σ e² / s²`` and
    ``H = -Σ p log p = log s - Σ e log e / s``, a sum of two non-negative terms (no cancellation)."""
    out = {"target": z.gather(1, t[:, None]).squeeze(1)}
    if "zmean" in want:
        out["zmean"] = z.mean(1)
    if "top1" in want:
        out["top1"] = z.argmax(1) == t  # the first argmax, as the Triton kernel
    total = _exp_shifted_(z, zmax, want_sum=True)
    log_total = total.log()
    out["lse"] = zmax + log_total
    if "sumsq" in want:
        # by column blocks: vector_norm down a vocabulary-major chunk's strided dimension loses ~1e-4 relative
        out["sumsq"] = sum(blk.square().sum(1) for blk in z.split(_LOGIT_COLS, 1)) / total.square()
    if "entropy" in want:
        out["entropy"] = log_total - torch.special.xlogy(z, z, out=z).sum(1) / total  # consumes e
    return out


def _cap_derivative(z: Tensor, ep: Epilogue) -> Tensor | None:
    """``dz/du`` of a softcap epilogue, ``inp·out·(1 - tanh²)`` with ``tanh = z/out``; read before z is consumed."""
    if not ep.tanh:
        return None
    return (z / ep.out).square_().neg_().add_(1.0).mul_(ep.inp * ep.out)


def _grad_from_probs(
    p: Tensor,
    t: Tensor,
    lse: Tensor,
    alpha: Tensor,
    beta: Tensor | None,
    gamma: Tensor | None,
    delta: Tensor | None,
    dcap: Tensor | None,
    ep: Epilogue,
    factor_rows: bool,
) -> tuple[Tensor, Tensor | None]:
    """Turn the softmax ``p`` of a chunk into ``dL/du`` in place (``u`` = pre-epilogue logits); every row's target
    ``t`` is a column of ``p`` (for a vocabulary block, callers zero ``gamma`` where the target lies outside).

    Returns ``(du, rows)``: if ``rows`` is not None the true gradient is ``rows[:, None] * du``. Pulling the
    per-token factor ``alpha`` out of the ``[chunk x vocab]`` block (it is applied to the small ``[chunk x hidden]``
    GEMM operands instead) saves a full pass over the block; done only where exact (``alpha`` has no zero, no
    entropy term) and when the caller's GEMMs run in fp32.
    """
    if beta is None and factor_rows and bool((alpha != 0).all()):
        rows = alpha * ep.inp if dcap is None else alpha
        if gamma is not None:
            p.scatter_add_(1, t[:, None], (gamma / alpha)[:, None])
        if delta is not None:
            p.add_((delta / alpha)[:, None])
        if dcap is not None:
            p.mul_(dcap)
        return p, rows
    if beta is not None:
        plogp = torch.special.xlogy(p, p).mul_(beta[:, None])
        p.mul_(alpha[:, None]).add_(plogp)
        del plogp
    else:
        p.mul_(alpha[:, None])
    if gamma is not None:
        p.scatter_add_(1, t[:, None], gamma[:, None])
    if delta is not None:
        p.add_(delta[:, None])
    if dcap is not None:
        p.mul_(dcap)
    elif ep.inp != 1.0:
        p.mul_(ep.inp)
    return p, None


def _accumulate(
    du: Tensor,
    rows: Tensor | None,
    h: Tensor,
    weight: Tensor,
    dx_out: Tensor | None,
    dw: Tensor | None,
    db: Tensor | None,
    first: bool = False,
) -> None:
    """dX_c = dU·W (old W), dW += dUᵀ·X_c, db += Σ dU, with the GEMMs in the weight's dtype like autograd.

    ``rows`` (fp32 path only) is a per-token factor of ``dU`` applied to the ``[chunk x hidden]`` operands.
    ``first``: ``dw`` is uninitialized and gets ``dUᵀ·X_c`` written (saves zero-filling and re-reading it)."""
    du_lp = du if du.dtype == weight.dtype else du.to(weight.dtype)
    if dw is not None:
        if rows is None:
            hs = h
        elif dx_out is not None and dx_out.dtype == h.dtype:  # dX's rows as scratch (written after): no temporary
            hs = torch.mul(h, rows[:, None], out=dx_out)
        else:
            hs = h * rows[:, None]
        if dw.dtype == du_lp.dtype:
            a, b = du_lp.t(), hs if hs.dtype == dw.dtype else hs.to(dw.dtype)
        else:  # fp32 accumulator for low-precision weights: exact products of the rounded operands
            a, b = du_lp.t().to(dw.dtype), hs.to(dw.dtype)
        if first:
            torch.mm(a, b, out=dw)
        else:
            dw.addmm_(a, b)
    if dx_out is not None:
        if dx_out.dtype == weight.dtype:
            # on CPU summed over vocabulary blocks: MKL's packing buffer then stays ~5 MiB instead of ~9 at 32k rows,
            # at the same speed (one GEMM on a GPU: each block would be a launch)
            blk = weight.shape[0] if du_lp.is_cuda else _DX_ROWS
            for v0 in range(0, weight.shape[0], blk):
                _mm_long_(dx_out, du_lp[:, v0:v0 + blk], weight[v0:v0 + blk], accumulate=v0 > 0)
        else:
            dx_out.copy_(du_lp @ weight)
        if rows is not None:
            dx_out.mul_(rows[:, None])
    if db is not None:
        if rows is not None:
            db.add_(torch.mv(du_lp.t(), rows.to(du_lp.dtype)).to(db.dtype))
        else:
            db.add_(du_lp.sum(0, dtype=db.dtype) if du_lp.dtype != db.dtype else du_lp.sum(0))


def default_chunk_size(n_tokens: int, hidden: int, vocab: int, logit_bytes: int = 4) -> int:
    """Tokens per chunk: a multiple of 128 from 128 on, else a power of two.

    The ``[chunk x vocab]`` block of logits is sized to at least 2.5x the fp32 hidden states and to at least
    256 fp32 rows — each chunk re-reads and re-writes the ``[vocab x hidden]`` weight-gradient accumulator, so fewer
    than ~256 tokens per chunk makes that accumulation memory-bound (measured on CPU at vocab 128256: 27.1 s at 128
    tokens, 23.8 s at 256, 23.0 s at 512), and larger chunks run each GEMM closer to the machine's peak (CPU, vocab
    32768, hidden 1024, 8192 tokens, against torch's ``F.linear_cross_entropy`` in one A/B: 640 tokens per chunk
    0.78x its time, 512 tokens 0.83x, for 16 MiB more) — and never above 256 MiB. ``logit_bytes``: bytes per
    stored logit (4 on the torch path; the Triton path keeps them in the weight's dtype, so a bf16 model gets twice
    the tokens in the bytes fp32 logits would take, and half the accumulator traffic).
    """
    budget = min(max(10 * n_tokens * hidden, 256 * vocab * 4), 256 << 20)
    c = max(budget // (logit_bytes * vocab), 16)
    c = c - c % 128 if c >= 128 else 1 << (int(c).bit_length() - 1)
    return int(max(1, min(c, n_tokens)))


def aligned_block(rows: int) -> int:
    """A vocabulary block of at most ``rows`` rows (at least 16): a multiple of 128 from 128 on, else of 16, so that
    a ``[tokens x block]`` logits block in bf16 has a 16-byte-aligned row stride (cuBLAS falls back to much slower
    kernels otherwise) and its weight slice starts on a GEMM tile boundary."""
    return max(16, rows - rows % (128 if rows >= 128 else 16))


def _walk_rows(n: int, vocab: int, hidden: int, block_bytes: int | None = None,
               weight_block_bytes: int | None = None) -> int:
    """Vocabulary rows per block of :func:`head_backward_vocab_blocks` for ``n`` tokens."""
    block_bytes, weight_block_bytes = block_bytes or (32 << 20), weight_block_bytes or (4 << 20)
    return aligned_block(min(vocab, block_bytes // max(4 * n, 1), weight_block_bytes // max(4 * hidden, 1)))


def vocab_walk_bytes(n: int, vocab: int, hidden: int) -> int:
    """What :func:`head_backward_vocab_blocks` allocates at once for ``n`` tokens (fp32): one ``[n x block]`` logits
    block and one ``[block x hidden]`` weight-gradient block (at most 32 + 4 MiB)."""
    rows = min(vocab, _walk_rows(n, vocab, hidden))
    return 4 * rows * (n + hidden)


def _dw_buffer(weight: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """Weight-gradient accumulator; left uninitialized when the first chunk writes it (``_accumulate(first=True)``)."""
    make = torch.empty if n > 0 else torch.zeros
    return make(weight.shape, dtype=dtype, device=weight.device)


def _buffer(n: int, chunk: int, vocab: int, device: torch.device, vocab_major: bool = False,
            dtype: torch.dtype = torch.float32) -> Tensor:
    """Logits buffer (fp32, or :func:`compute_dtype`) for chunks of up to ``chunk`` tokens; :func:`_chunk_view`
    takes each chunk's ``[c x V]``.

    ``vocab_major``: each chunk is stored as a contiguous ``[V x c]`` (flat buffer) and used through its transposed
    view. The three GEMMs of a 3-GEMM chunk then run with the vocabulary as the long contiguous dimension of their
    output or operand, which MKL runs faster on CPU (AMD EPYC, 640 x 1024 x 32768: logits 157 -> 195 GFLOP/s, dW
    174 -> 185); the exponentials then run in column blocks (:func:`_exp_shifted_`), as a softmax down the strided
    dimension would walk memory ~3x slower.
    """
    c = min(n, chunk)
    if vocab_major:
        return torch.empty(c * vocab, dtype=dtype, device=device)
    return torch.empty(c, vocab, dtype=dtype, device=device)


def _chunk_view(buf: Tensor, c: int, vocab: int) -> Tensor:
    """The ``[c x V]`` logits of a chunk of ``c`` tokens in ``buf`` (from :func:`_buffer`)."""
    return buf[: c * vocab].view(vocab, c).t() if buf.dim() == 1 else buf[:c]


def _vocab_major(hidden: Tensor, weight: Tensor) -> bool:
    """The chunk layout on the torch path: vocabulary-major for fp32 on CPU (faster GEMMs, see :func:`_buffer`)."""
    return full_precision(weight) and hidden.device.type == "cpu"


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
    """Per-token ``lse``, target logit and optionally entropy, mean logit, ``Σ p²`` and target-is-argmax of
    ``z = ep(hidden Wᵀ + b)``. ``hidden`` is ``[N, D]``, ``targets`` ``[N]`` with every index valid (callers
    compact ignored tokens away)."""
    n = hidden.shape[0]
    flags = {"entropy": need_entropy, "zmean": need_zmean, "sumsq": need_sumsq, "top1": need_top1}
    want = frozenset(k for k, v in flags.items() if v)
    f32 = dict(dtype=compute_dtype(weight), device=hidden.device)
    res = {k: torch.empty(n, **f32) for k in ("lse", "target", *sorted(want - {"top1"}))}
    if need_top1:
        res["top1"] = torch.empty(n, dtype=torch.bool, device=hidden.device)
    buf = _buffer(n, chunk_size, weight.shape[0], hidden.device, _vocab_major(hidden, weight), f32["dtype"])
    zmax = torch.empty(min(n, chunk_size), **f32)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        z = _chunk_logits(hidden[s:e], weight, bias, ep, buf, row_max=zmax[: e - s])
        for k, v in _stats_of_chunk(z, zmax[: e - s], targets[s:e], want).items():
            res[k][s:e] = v
    return Stats(**res)


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
    """Recompute the logits chunk by chunk and return ``(dX, dW, db)`` for the per-token coefficients."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if need_dw and weight.dtype != accum_dtype:
        return _backward_low_precision(hidden, weight, bias, targets, lse, ep, alpha, beta, gamma, delta,
                                       need_dx=need_dx, need_db=need_db)
    dx = torch.empty_like(hidden) if need_dx else None
    dw = _dw_buffer(weight, n, accum_dtype) if need_dw else None
    db = torch.zeros(vocab, dtype=accum_dtype, device=weight.device) if need_db else None
    buf = _buffer(n, chunk_size, vocab, hidden.device, _vocab_major(hidden, weight), compute_dtype(weight))

    def part(x: Tensor | None, s: int, e: int) -> Tensor | None:
        return None if x is None else x[s:e]

    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        h = hidden[s:e]
        z = _chunk_logits(h, weight, bias, ep, buf)
        dcap = _cap_derivative(z, ep)
        p = z
        _exp_shifted_(p, lse[s:e])  # p = exp(z - lse): lse from the forward, no max or sum pass
        du, rows = _grad_from_probs(p, targets[s:e], lse[s:e], alpha[s:e], part(beta, s, e), part(gamma, s, e),
                                    part(delta, s, e), dcap, ep, factor_rows=full_precision(weight))
        del dcap
        _accumulate(du, rows, h, weight, part(dx, s, e), dw, db, first=s == 0)
    return dx, dw, db


def _backward_low_precision(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, lse: Tensor,
                            ep: Epilogue, alpha: Tensor, beta: Tensor | None, gamma: Tensor | None,
                            delta: Tensor | None, *, need_dx: bool, need_db: bool):
    """``head_backward`` for low-precision weights with an fp32 weight-gradient accumulator, in vocabulary blocks:
    each block's ``dW`` is summed over every token in fp32 and rounded once into the weight's dtype (as autograd's
    single GEMM does), so no fp32 ``[vocab x hidden]`` accumulator (4·V·H bytes) nor its final copy ever exists."""
    return grads_from_blocks(head_backward_vocab_blocks, hidden, weight, bias, targets, lse, ep,
                             [alpha, beta, gamma, delta], need_dx=need_dx, need_db=need_db)


def grads_from_blocks(vocab_blocks: Callable[..., tuple[Tensor | None, Tensor | None]], hidden: Tensor,
                      weight: Tensor, bias: Tensor | None, targets: Tensor, lse: Tensor, ep: Epilogue,
                      coef: list[Tensor | None], *, need_dx: bool, need_db: bool, **budgets: int,
                      ) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """``(dX, dW, db)`` from a ``head_backward_vocab_blocks`` (either backend's): each block's gradient is written
    into ``dW`` (and ``db``), in the weight's dtype, as it completes."""
    dw = torch.empty_like(weight)
    db = torch.empty_like(bias) if need_db and bias is not None else None

    def keep(v0: int, v1: int, dw_blk: Tensor, db_blk: Tensor | None) -> None:  # dW blocks are written in place
        if db is not None:
            db[v0:v1] = db_blk

    dx, _ = vocab_blocks(hidden, weight, bias, targets, lse, ep, *coef, keep, need_dx=need_dx,
                         need_db=db is not None, dw_out=dw, **budgets)
    return dx, dw, db


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
    """Like :func:`head_backward`, but walks the vocabulary in row blocks: each block's weight gradient
    ``dW[v0:v1]`` (and bias gradient) is complete once computed and is handed to ``on_weight_block(v0, v1, dW_blk,
    db_blk)`` at once (an optimizer applies it and drops it); the full ``dW`` never exists. Returns ``(dX, db)``
    with ``db`` None (it went to the callback). ``lse`` from the forward makes each block's softmax exact.
    A block keeps both its ``[tokens x block]`` logits under ``block_bytes`` and its ``[block x hidden]`` weight
    gradient under ``weight_block_bytes`` (None: 32 MiB and 4 MiB, cache-sized work for a CPU). With ``dw_out``
    (``[vocab x hidden]``, the weight's dtype) each block's gradient is formed in ``dw_out[v0:v1]``, the view the
    callback then receives (no copy)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    vb = _walk_rows(n, vocab, hidden.shape[1], block_bytes, weight_block_bytes)
    dx = torch.zeros(hidden.shape, dtype=compute_dtype(weight), device=hidden.device) if need_dx else None
    lp = not full_precision(weight)
    for v0 in range(0, vocab, vb):
        v1 = min(v0 + vb, vocab)
        w_blk = weight[v0:v1]
        z = _chunk_logits(hidden, w_blk, None if bias is None else bias[v0:v1], ep, None)
        dcap = _cap_derivative(z, ep)
        p = z.sub_(lse[:, None]).exp_()
        # the target term only for rows whose target is in this block: a masked scatter (adds 0.0 elsewhere,
        # exactly) instead of gathering those rows, which would cost a device-to-host sync per block
        inside = (targets >= v0) & (targets < v1)
        g_blk = None if gamma is None else gamma * inside
        p, _ = _grad_from_probs(p, (targets - v0).clamp_(0, v1 - v0 - 1), lse, alpha, beta, g_blk, delta, dcap, ep,
                                factor_rows=False)
        du = p if not lp else p.to(weight.dtype)
        if dx is not None:
            _mm_f32(du, w_blk, dx) if lp else _mm_long_(dx, du, w_blk, accumulate=True)
        if dw_out is None:
            dw_blk = (du.t() @ hidden) if not lp else _mm_f32(du.t(), hidden).to(weight.dtype)
        elif lp:
            dw_blk = dw_out[v0:v1].copy_(_mm_f32(du.t(), hidden))
        else:
            dw_blk = torch.mm(du.t(), hidden, out=dw_out[v0:v1])
        db_blk = du.sum(0, dtype=compute_dtype(weight)).to(bias.dtype) if (need_db and bias is not None) else None
        del p, z, dcap
        on_weight_block(v0, v1, dw_blk, db_blk)
    return (None if dx is None else dx.to(hidden.dtype)), None


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
    """``Σ_i w_i · CE_i`` and its gradients ``(loss, dX, dW, db)`` in one pass over the logits.

    ``token_weight`` ``[N]`` carries the reduction (``1/n_valid`` for a mean, ``1/num_items_in_batch``, ...).
    ``CE_i = (1-ε)(lse - z_t) + ε(lse - mean z) + λ·lse²`` with ε = ``label_smoothing``, λ = ``z_loss``.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    want_grad = need_dx or need_dw or need_db
    dx = torch.empty_like(hidden) if need_dx else None
    dw = _dw_buffer(weight, n, accum_dtype) if need_dw else None
    db = torch.zeros(vocab, dtype=accum_dtype, device=weight.device) if need_db else None
    acc = compute_dtype(weight)
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    buf = _buffer(n, chunk_size, vocab, hidden.device, _vocab_major(hidden, weight), acc)
    zmax = torch.empty(min(n, chunk_size), dtype=acc, device=hidden.device)
    eps = float(label_smoothing)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        h, t, w = hidden[s:e], targets[s:e], token_weight[s:e]
        z = _chunk_logits(h, weight, bias, ep, buf, row_max=zmax[: e - s])
        zt = z.gather(1, t[:, None]).squeeze(1)
        zmean = z.mean(1) if eps else None
        dcap = _cap_derivative(z, ep) if want_grad else None
        total = _exp_shifted_(z, zmax[: e - s], want_sum=True)  # z now holds p·total
        lse = zmax[: e - s] + total.log()
        ce = lse - zt
        if eps:
            ce = (1 - eps) * ce + eps * (lse - zmean)
        if z_loss:
            ce = ce + z_loss * lse.square()
        loss += (w * ce).sum()
        if want_grad:
            alpha = w * (1 + 2 * z_loss * lse) if z_loss else w
            gamma = -(1 - eps) * w
            delta = -(eps / vocab) * w if eps else None
            # alpha·p = (alpha / total)·z: the normalisation rides on the per-token factor (no pass over the chunk)
            du, rows = _grad_from_probs(z, t, lse, alpha / total, None, gamma, delta, dcap, ep,
                                        factor_rows=full_precision(weight))
            del dcap
            _accumulate(du, rows, h, weight, None if dx is None else dx[s:e], dw, db, first=s == 0)
    return loss, dx, dw, db


def fold_column_ops(weight: Tensor, bias: Tensor | None, column_ops: list[tuple[str, Tensor]],
                    ) -> tuple[Tensor, Tensor | None]:
    """Fold per-vocabulary-column ``("mul", S)`` / ``("add", C)`` ops applied to the logits, in order, into the head:
    ``(h Wᵀ + b) ⊙ S + C == h (S ⊙ W)ᵀ + (S ⊙ b + C)``, differentiable in ``W``, ``b``, ``S`` and ``C``. A bias
    alone leaves the weight itself (the parameter) to the kernels.

    Example::

        w2, b2 = fold_column_ops(w, None, [("mul", scale), ("add", offset)])
        # h @ w2.T + b2 == (h @ w.T) * scale + offset
    """
    scale = add = None
    for op, t in column_ops:
        t = t.reshape(-1).float()
        if op == "mul":
            scale, add = (t if scale is None else scale * t), (None if add is None else add * t)
        else:
            add = t if add is None else add + t
    if scale is not None:
        weight = (weight.float() * scale[:, None]).to(weight.dtype)
        bias = None if bias is None else (bias.float() * scale).to(bias.dtype)
    if add is not None:
        bias = add.to(weight.dtype) if bias is None else (bias.float() + add).to(bias.dtype)
    return weight, bias
