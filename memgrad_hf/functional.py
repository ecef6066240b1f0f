"""The LM-head math as plain functions: cross-entropy, per-token log-probs and entropies of ``hidden @ weight.T``
without materializing the ``[tokens x vocab]`` logits, with exact gradients.

Example::

    import torch
    from memgrad_hf.functional import linear_cross_entropy, linear_logprobs

    hidden = torch.randn(4, 128, 64, requires_grad=True)      # [batch, seq, hidden]
    weight = torch.randn(32000, 64, requires_grad=True)       # lm_head.weight, [vocab, hidden]
    labels = torch.randint(0, 32000, (4, 128))                # already aligned with hidden (no shift here)
    loss = linear_cross_entropy(hidden, weight, labels)       # == F.cross_entropy(hidden @ weight.T, labels)
    loss.backward()
    logp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True)

Thin layer: validates arguments and dispatches to :mod:`memgrad_hf.kernels` (torch on CPU; the Triton path
plugs in at :func:`memgrad_hf.kernels.backend`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from memgrad_hf.engine import refuse_func_transforms
from memgrad_hf.kernels import head as K
from memgrad_hf.kernels import head_impl
from memgrad_hf.kernels.head_autograd import ChunkedHeadStats, FusedLinearCrossEntropy, retain_head_grads

_REDUCTIONS = ("mean", "sum", "none")


# ---------------------------------------------------------------------------------------------------- helpers


def check_chunk_size(chunk_size: int | None) -> None:
    """Refuse a ``chunk_size`` that is not a positive int or None (automatic)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk) or None for automatic; "
                         f"got {chunk_size!r}.")


def _check(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Tensor | None, chunk_size: int | None, name: str,
           softcap: float | None = None, logit_scale: float = 1.0, weight_grad_consumer: Any = None):
    refuse_func_transforms(
        "the chunked LM head (memgrad_hf.functional)",
        "Use the transform on full logits (F.cross_entropy / log_softmax of hidden @ weight.T) instead, or compute "
        "per-example gradients with ordinary autograd (one backward per example).",
    )
    if not isinstance(hidden, Tensor) or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating-point tensor [..., hidden_size]; got {_desc(hidden)}.")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D floating-point tensor [vocab, hidden_size]; got {_desc(weight)}.")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dim ({hidden.shape[-1]}) must equal weight.shape[1] ({weight.shape[1]}): "
            "pass lm_head.weight as [vocab, hidden_size] (not transposed)."
        )
    if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"{name} must be an integer tensor of token ids; got {_desc(ids)}. Use {name}.long().")
    if tuple(ids.shape) != tuple(hidden.shape[:-1]) and tuple(ids.shape) == tuple(weight.shape[:-1]):
        raise ValueError(
            f"{name} shape {tuple(ids.shape)} matches weight's leading shape, not hidden's: are hidden and weight "
            "swapped? The order is (hidden [..., H], weight [V, H], ...) (Liger's fused loss takes the weight first)."
        )
    if tuple(ids.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{name} shape {tuple(ids.shape)} must equal hidden's leading shape {tuple(hidden.shape[:-1])}; "
            "for next-token prediction pair hidden[..., :-1, :] with labels[..., 1:]."
        )
    if bias is not None and not isinstance(bias, Tensor):
        raise ValueError(f"bias must be a [vocab] tensor or None; got {_desc(bias)}.")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [vocab] = [{weight.shape[0]}]; got {_desc(bias)}.")
    check_chunk_size(chunk_size)
    if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        raise ValueError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ; cast one of them "
            "(e.g. hidden.to(weight.dtype)) or run under torch.autocast as the model does."
        )
    if bias is not None and bias.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        raise ValueError(f"bias ({bias.dtype}) and weight ({weight.dtype}) dtypes differ; cast the bias "
                         "(bias.to(weight.dtype)) or run under torch.autocast as the model does.")
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be a positive finite number (the tanh cap), or None for no cap; got "
                         f"{softcap!r}.")
    if not math.isfinite(logit_scale):
        raise ValueError(f"logit_scale must be a finite number (1.0: none); got {logit_scale!r}.")
    if weight_grad_consumer is not None and not callable(weight_grad_consumer):
        raise ValueError(f"weight_grad_consumer must be callable as f(v0, v1, dW_block, db_block) or None; got "
                         f"{_desc(weight_grad_consumer)}.")


def _desc(x: Any) -> str:
    return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})" if isinstance(x, Tensor) else type(x).__name__


def _autocast(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Cast like ``nn.Linear`` under autocast (differentiably), so the kernels see one dtype. As autocast does,
    fp64 tensors are left alone."""
    dev = hidden.device.type
    if not torch.is_autocast_enabled(dev):
        return hidden, weight, bias
    dt = torch.get_autocast_dtype(dev)
    hidden, weight, bias = (t if t is None or t.dtype == torch.float64 else t.to(dt) for t in (hidden, weight, bias))
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"under torch.autocast({dev!r}) hidden, weight and bias are {hidden.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}: autocast leaves fp64 tensors alone, so pass all of "
                         "them in fp64 or none.")
    return hidden, weight, bias


def _compact(hidden2d: Tensor, ids: Tensor, ignore_index: int | None, vocab: int,
             name: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """Drop ignored positions before the matmul (saves work in proportion to the mask) and check that the rest are
    ids in ``[0, vocab)``, with one host sync for both (each sync stalls the host's launch queue on a GPU)."""
    if not ids.numel():
        return hidden2d, ids, None
    if ids.dtype == torch.uint8:  # ignore_index=-100 would wrap to 156 there, and a real id 156 be dropped
        ids = ids.long()
    valid = torch.ones_like(ids, dtype=torch.bool) if ignore_index is None else ids != ignore_index
    kept = torch.where(valid, ids, 0)  # ignored positions read as id 0: in range, so only real ids can fail
    n_valid, lo, hi = torch.stack([valid.sum(), kept.amin().long(), kept.amax().long()]).tolist()
    if lo < 0 or hi >= vocab:
        raise ValueError(
            f"{name} holds ids outside [0, {vocab}) (min {lo}, max {hi}) besides ignore_index; check the "
            "tokenizer/vocab size or the ignore_index value."
        )
    if n_valid == ids.numel():
        return hidden2d, ids, None
    # the valid positions in order, without the second sync nonzero() would take: a stable sort puts them first
    idx = torch.argsort((~valid).to(torch.uint8), stable=True)[:n_valid]
    return hidden2d.index_select(0, idx), ids.index_select(0, idx), idx


def _accum_dtype(weight: Tensor, accum_dtype: torch.dtype | None) -> torch.dtype:
    if accum_dtype is None:
        return K.compute_dtype(weight)
    if accum_dtype not in (torch.float32, weight.dtype):
        raise ValueError(
            f"accum_dtype must be torch.float32 or the weight's dtype ({weight.dtype}); got {accum_dtype}."
        )
    return accum_dtype


def _stats_chunks(chunk_size: int | None, n: int, hidden: Tensor, weight: Tensor,
                  consumer: Any = None) -> tuple[int, int]:
    """Tokens per chunk for :class:`ChunkedHeadStats`: ``(forward, backward)``.

    On the Triton path logits live in the weight's dtype, so the byte budget of ``default_chunk_size`` holds twice
    the bf16 tokens (as for the fused cross-entropy). The backward holds the whole weight gradient (unless a
    consumer takes it in blocks) plus one ``backward x vocab`` logits block; the forward holds one ``forward x
    vocab`` logits buffer and nothing else of that size. So a forward chunk of ``backward + hidden`` tokens (the
    gradient's bytes spent on logits rows) never raises the call's peak, and its logits GEMMs are fewer and larger
    (GRPO at Qwen2.5's vocabulary, bf16: 1408 tokens per chunk, 512 in backward, where both were 256; cuBLAS ran
    the 256-token GEMMs at ~75% of the rate of 820-token ones on an H100). The torch path keeps several
    chunk-sized fp32 temporaries: one chunk size both ways.
    """
    if chunk_size is not None:
        return chunk_size, chunk_size
    vocab, dim = weight.shape
    if not getattr(head_impl(hidden.device, weight.dtype), "LOGITS_IN_WEIGHT_DTYPE", False):
        chunk = K.default_chunk_size(max(n, 1), dim, vocab)
        return chunk, chunk
    chunk = K.default_chunk_size(max(n, 1), dim, vocab, weight.element_size())
    if consumer is not None or not (weight.requires_grad and torch.is_grad_enabled()):
        return chunk, chunk
    fwd = chunk + dim
    return (fwd - fwd % 128 if fwd >= 128 else fwd), chunk


def _fused_chunk(n: int, weight: Tensor, acc: torch.dtype, hold: bool) -> int:
    """Tokens per chunk of the Triton fused cross-entropy, whose logits live in the weight's dtype: a bf16 chunk
    fills ``default_chunk_size``'s byte budget with twice the tokens. Each chunk re-reads and re-writes the fp32
    weight-gradient accumulator of a low-precision weight, so fewer chunks are less traffic; and the backward casts
    that accumulator to the weight's dtype beside it (``vocab x hidden`` more), so a forward logits buffer of that
    size (``hidden`` tokens) never raises the peak (vocab 128256, hidden 1024, bf16: 1024 tokens per chunk, half
    the accumulator's passes of 512). Not when the gradient is handed over in blocks (``hold``): no cast then."""
    vocab, dim = weight.shape
    chunk = K.default_chunk_size(max(n, 1), dim, vocab, weight.element_size())
    if acc != weight.dtype and not hold and weight.requires_grad and torch.is_grad_enabled():
        chunk = max(chunk, dim - dim % 128 if dim >= 128 else dim)
    return min(chunk, max(n, 1))


# ---------------------------------------------------------------------------------------------------- public


@torch.compiler.disable  # chunk loops: opaque to torch.compile (GEMM-bound anyway; avoids unrolled graphs)
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    reduction: str = "mean",
    num_items_in_batch: int | Tensor | None = None,
    chunk_size: int | None = None,
    accum_dtype: torch.dtype | None = None,
    grad_in_forward: bool | None = None,
    weight_grad_consumer: Any = None,
) -> Tensor:
    """Cross-entropy of ``z = softcap·tanh(logit_scale·(hidden @ weight.T + bias)/softcap)`` against ``labels``.

    Equals ``F.cross_entropy(z.float().flatten(0, -2), labels.flatten(), ignore_index=..., label_smoothing=...,
    reduction=...)`` without ever building ``z``. With ``z_loss`` each non-ignored token's loss gains
    ``z_loss·lse²`` (``lse`` its logits' log-sum-exp) before the reduction, as in Liger's and PaLM's z-loss: for
    ``"mean"`` that adds ``z_loss·mean(lse²)`` over the non-ignored tokens.

    Args:
        hidden: ``[..., H]`` hidden states (fp32/bf16/fp16/fp64).
        weight: ``[V, H]`` output-embedding matrix. ``bias``: optional ``[V]``.
        labels: ``[...]`` target ids, aligned with ``hidden`` (not shifted here); ``ignore_index`` is skipped
            (``None``: every position is a target).
        label_smoothing: ε of ``F.cross_entropy``. ``z_loss``: λ of the auxiliary ``λ·lse²`` term.
        softcap, logit_scale: final-logit softcapping and a multiplier on the logits (Gemma-2, Cohere, ...).
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"`` (per token, 0 where ignored).
        num_items_in_batch: if given, the loss is ``sum / num_items_in_batch`` (what HF's Trainer passes under
            gradient accumulation); ``reduction`` must then not be ``"none"``.
        chunk_size: tokens per chunk (default: automatic, see ``kernels.head.default_chunk_size``).
        accum_dtype: dtype of the weight-gradient accumulator; default fp32 (exact for bf16 models), or the
            weight's dtype to save ``4·V·H`` bytes.
        grad_in_forward: compute the gradients during the forward pass (no recompute, 6·N·V·H flops; the weight
            gradient then lives from forward to backward). ``False`` recomputes the logits in backward (8·N·V·H
            flops) so the weight gradient exists only from the head's backward on — what an optimizer that consumes
            gradients during backward (FORGE) wants — and, for low-precision weights with the fp32 accumulator,
            is summed per vocabulary block straight into the weight's dtype (no fp32 ``[V x H]`` buffer). Default
            (None): ``True`` when the weight-gradient accumulator has the weight's dtype (fp32 models) or with the
            Triton backend (``MEMGRAD_BACKEND=triton``), else ``False`` (bf16/fp16 models: 4·V·H + 2·V·H bytes less
            at the peak for a third more head flops).
        weight_grad_consumer: ``f(v0, v1, dW_block, db_block)``; if given, the weight (and bias) gradient is handed
            over one block of vocabulary rows at a time during backward instead of being returned to autograd
            (FORGE's fused head). By default the logits are then recomputed in backward and the full weight
            gradient never exists; with ``grad_in_forward=True`` (explicitly) the gradient computed in forward is
            held until backward and handed over from there (fewer flops, one ``[V x H]`` buffer meanwhile). A
            consumer with ``applies_update = True`` (an optimizer step) is passed over where the backward does not
            accumulate into the weight (``torch.autograd.grad``, ``backward(inputs=...)``): the gradient then
            returns to autograd, as it would without a consumer.

    Returns:
        A scalar (or ``[...]`` for ``reduction="none"``), fp32 (fp64 for an fp64 weight, which HF's own loss
        rounds to fp32).

    Example::

        import torch
        from memgrad_hf.functional import linear_cross_entropy
        hidden = torch.randn(2, 16, 64, requires_grad=True)      # the LM head's input
        weight = torch.randn(1000, 64, requires_grad=True)       # lm_head.weight, [vocab, hidden]
        labels = torch.randint(0, 1000, (2, 16))
        loss = linear_cross_entropy(hidden[:, :-1], weight, labels[:, 1:])   # next-token loss, no [32 x 1000] logits
        loss.backward()
    """
    _check(hidden, weight, labels, bias, chunk_size, "labels", softcap, logit_scale, weight_grad_consumer)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}; got {reduction!r}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1] (as F.cross_entropy); got {label_smoothing}.")
    if z_loss < 0:
        raise ValueError(f"z_loss must be >= 0; got {z_loss}.")
    if num_items_in_batch is not None and reduction == "none":
        raise ValueError("num_items_in_batch normalizes a summed loss; use reduction='mean' or 'sum' with it.")
    # (0 divides as torch does: a batch without targets; a tensor is not read: no host sync)
    if isinstance(num_items_in_batch, (int, float)) and not num_items_in_batch >= 0:
        raise ValueError(f"num_items_in_batch must be >= 0 (the number of target tokens); got {num_items_in_batch}.")
    hidden, weight, bias = _autocast(hidden, weight, bias)
    acc = _accum_dtype(weight, accum_dtype)
    lead = labels.shape
    h2, ids = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    hv, tv, idx = _compact(h2, ids, ignore_index, weight.shape[0], "labels")
    tv = tv.long()
    ep = K.Epilogue.make(logit_scale=logit_scale, softcap=softcap)
    chunk = chunk_size or K.default_chunk_size(max(tv.numel(), 1), weight.shape[1], weight.shape[0])
    n_valid = tv.numel()

    if reduction == "none":
        chunks = _stats_chunks(chunk_size, n_valid, hv, weight, weight_grad_consumer)
        lse, zt, _, zmean, _, _ = ChunkedHeadStats.apply(hv, weight, bias, tv, ep, chunks, False,
                                                          label_smoothing > 0, acc, weight_grad_consumer)
        ce = _ce_from_stats(lse, zt, zmean, label_smoothing, z_loss)
        if idx is None:
            return ce.reshape(lead)
        return torch.zeros(ids.numel(), dtype=ce.dtype, device=ce.device).index_put((idx,), ce).reshape(lead)

    acc_out = K.compute_dtype(weight)  # fp32; fp64 for an fp64 weight
    if num_items_in_batch is not None:
        denom = num_items_in_batch
    elif reduction == "mean":
        denom = n_valid  # 0 valid tokens -> nan, as F.cross_entropy
    else:
        denom = 1
    if n_valid == 0:
        # zero gradients (as torch's ignored rows get) and the value 0 / denom (nan for a mean over no token); the
        # division stays off the graph: 0 * (1 / 0) would make the gradients nan, and a Trainer's weights with them
        # (an empty slice's sum, not t.sum() * 0: that is nan where t holds an inf, a masked vocabulary row's bias)
        zero = sum(t.reshape(-1)[:0].sum() for t in (hv, weight, bias) if t is not None).to(acc_out)
        return zero + zero.detach() / denom
    hold = weight_grad_consumer is not None and grad_in_forward is True  # only when asked for explicitly
    if grad_in_forward is None:  # the Triton backend's fused kernel is its fast path
        grad_in_forward = acc == weight.dtype or getattr(head_impl(hv.device, weight.dtype), "PREFERS_FUSED", False)
    if not grad_in_forward or (weight_grad_consumer is not None and not hold):
        chunks = _stats_chunks(chunk_size, n_valid, hv, weight, weight_grad_consumer)
        lse, zt, _, zmean, _, _ = ChunkedHeadStats.apply(hv, weight, bias, tv, ep, chunks, False,
                                                          label_smoothing > 0, acc, weight_grad_consumer)
        total = _ce_from_stats(lse, zt, zmean, label_smoothing, z_loss).sum()
        return total / (denom.to(total.device) if isinstance(denom, Tensor) else float(denom))
    if chunk_size is None and getattr(head_impl(hv.device, weight.dtype), "LOGITS_IN_WEIGHT_DTYPE", False):
        chunk = _fused_chunk(n_valid, weight, acc, hold)
    if isinstance(denom, Tensor):
        w = (1.0 / denom.to(device=hv.device, dtype=acc_out)).expand(n_valid)
    else:
        w = torch.full((n_valid,), 1.0 / float(denom) if denom else math.inf, dtype=acc_out, device=hv.device)
    args = (hv, weight, bias, tv, w, ep, float(label_smoothing), float(z_loss), chunk, acc)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hv, weight, bias)):
        return FusedLinearCrossEntropy.apply(*args, weight_grad_consumer if hold else None)
    # No gradient wanted: skip the 2/3 of the work the fused forward would spend on gradients
    # (autograd.Function reports needs_input_grad=True even under no_grad).
    return head_impl(hv.device, weight.dtype).fused_cross_entropy(
        hv, weight, bias, tv, ep, w, label_smoothing=float(label_smoothing), z_loss=float(z_loss), chunk_size=chunk,
        need_dx=False, need_dw=False, need_db=False, accum_dtype=acc,
    )[0]


def _ce_from_stats(lse: Tensor, zt: Tensor, zmean: Tensor | None, eps: float, zl: float) -> Tensor:
    ce = lse - zt
    if eps:
        ce = (1 - eps) * ce + eps * (lse - zmean)
    if zl:
        ce = ce + zl * lse.square()
    return ce


@torch.compiler.disable
def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int | None = -100,
    chunk_size: int | None = None,
    accum_dtype: torch.dtype | None = None,
    diagnostics: dict | None = None,
    weight_grad_consumer: Any = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token ``log softmax(z)[token]`` (and entropy of ``softmax(z)``) with ``z = epilogue(hidden @ weight.T
    + bias) / temperature``, in chunks, differentiable with respect to hidden, weight and bias.

    Positions whose id equals ``ignore_index`` get log-prob 0 (and entropy 0) and cost nothing; pass
    ``ignore_index=None`` to score every position. Pass a dict as ``diagnostics`` to also receive, from the same
    pass and without gradient, ``mean_logits``, ``log_sum_sq_probs`` (log Σ p²) and ``is_top1`` (the token is the
    first argmax) per position. ``weight_grad_consumer`` is as in :func:`linear_cross_entropy`: the weight gradient
    is handed to it in vocabulary blocks during backward (recomputed there) and never exists as a tensor.

    Returns:
        ``logp`` ``[...]`` fp32 (fp64 for an fp64 weight), or ``(logp, entropy)`` if ``return_entropy``.

    Example::

        import torch
        from memgrad_hf.functional import linear_logprobs
        hidden, weight = torch.randn(4, 32, 64), torch.randn(1000, 64)
        completion = torch.randint(0, 1000, (4, 32))
        logp, entropy = linear_logprobs(hidden, weight, completion, temperature=0.9, return_entropy=True)  # [4, 32]
    """
    _check(hidden, weight, token_ids, bias, chunk_size, "token_ids", softcap, logit_scale, weight_grad_consumer)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}.")
    if diagnostics is not None and not isinstance(diagnostics, dict):
        raise ValueError(f"diagnostics must be a dict to fill (or None); got {_desc(diagnostics)}.")
    hidden, weight, bias = _autocast(hidden, weight, bias)
    acc = _accum_dtype(weight, accum_dtype)
    lead = token_ids.shape
    h2, ids = hidden.reshape(-1, hidden.shape[-1]), token_ids.reshape(-1)
    hv, tv, idx = _compact(h2, ids, ignore_index, weight.shape[0], "token_ids")
    tv = tv.long()
    ep = K.Epilogue.make(logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    chunks = _stats_chunks(chunk_size, tv.numel(), hv, weight, weight_grad_consumer)
    diag = diagnostics is not None
    lse, zt, ent, zmean, sumsq, top1 = ChunkedHeadStats.apply(hv, weight, bias, tv, ep, chunks, return_entropy, diag,
                                                               acc, weight_grad_consumer, diag)
    logp = zt - lse

    def scatter(v: Tensor) -> Tensor:
        if idx is None:
            return v.reshape(lead)
        return torch.zeros(ids.numel(), dtype=v.dtype, device=v.device).index_put((idx,), v).reshape(lead)

    if diag:
        diagnostics.update(mean_logits=scatter(zmean.detach()), log_sum_sq_probs=scatter(sumsq.log()),
                           is_top1=scatter(top1))
    return (scatter(logp), scatter(ent)) if return_entropy else scatter(logp)


__all__ = ["check_chunk_size", "linear_cross_entropy", "linear_logprobs", "retain_head_grads"]
