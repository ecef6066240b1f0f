"""The chunked head's autograd Functions, and how a weight gradient is handed to a consumer (FORGE's fused head)
in vocabulary blocks instead of being returned to autograd. :mod:`memgrad_hf.functional` validates the arguments
and calls these; the math is :mod:`memgrad_hf.kernels.head` (or its Triton twin, by device)."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from memgrad_hf.engine import accumulates_into, refuse_create_graph
from memgrad_hf.kernels import head_impl

# A plain global, not a threading.local: on a GPU autograd runs the backward on its own device thread, which would
# never see a flag set by the thread that called backward.
_RETAIN = {"on": False}


@contextmanager
def retain_head_grads():
    """Within this context the fused cross-entropy keeps its precomputed gradients through backward, so the same
    graph can be backpropagated again (``retain_graph=True``); costs one gradient-sized copy per backward.

    Example::

        with retain_head_grads():
            torch.autograd.backward(loss, retain_graph=True)   # e.g. a norm-only pass
        loss.backward()
    """
    prev = _RETAIN["on"]
    _RETAIN["on"] = True
    try:
        yield
    finally:
        _RETAIN["on"] = prev


def _consumes(consumer: Any, node_ctx: Any) -> bool:
    """Whether ``consumer`` takes this backward's weight gradient (see ``weight_grad_consumer``)."""
    return consumer is not None and (not getattr(consumer, "applies_update", False) or accumulates_into(node_ctx, 1))


def _refuse_create_graph() -> None:
    refuse_create_graph("the chunked LM head", "Compute this loss with full logits: model(..., skip_logits=False) on "
                        "a patched model (or patch_model(model, head=False)).")


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Scalar ``Σ w_i CE_i``; gradients are computed during forward and scaled by ``grad_output`` in backward."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, token_weight, ep, eps, zl, chunk, accum_dtype,
                weight_consumer=None):
        need = ctx.needs_input_grad
        ctx.weight_consumer = weight_consumer
        loss, dx, dw, db = head_impl(hidden.device, weight.dtype).fused_cross_entropy(
            hidden, weight, bias, targets, ep, token_weight,
            label_smoothing=eps, z_loss=zl, chunk_size=chunk,
            need_dx=need[0], need_dw=need[1], need_db=bias is not None and need[2],
            accum_dtype=accum_dtype,
        )
        ctx.grads = (dx, dw, db)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        # saved (references, no copy) for autograd's version check alone: the gradients above are the weight's as
        # it was in forward, so an in-place change before backward (an optimizer step between the two) must raise,
        # as it does for the logits' matmul in stock
        ctx.save_for_backward(weight, bias)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        _refuse_create_graph()
        if ctx.grads is None:
            raise RuntimeError(
                "memgrad_hf: backward through the fused cross-entropy a second time (retain_graph=True, "
                "torch.autograd.gradcheck): its gradients are computed in forward and handed to the first backward. "
                "Wrap the earlier backward in memgrad_hf.functional.retain_head_grads() (and, as for any second "
                "backward through a graph, pass it retain_graph=True) to keep them, or have the "
                "logits recomputed in each backward: patch_model(model, grad_in_forward=False) (under a FORGE "
                "optimizer its own option decides: optim_args head_grad=recompute), or grad_in_forward=False to "
                "linear_cross_entropy."
            )
        ctx.saved_tensors  # noqa: B018  (raises if the weight or bias changed in place since forward)
        dx, dw, db = ctx.grads
        retain = _RETAIN["on"]
        if not retain:
            ctx.grads = None  # drop our references so autograd can adopt the buffers without copying
        if dw is not None and _consumes(ctx.weight_consumer, ctx):
            if _defer(ctx.weight_consumer, _hand_over, ctx.weight_consumer, dw, db, grad, retain):
                _hand_over(ctx.weight_consumer, dw, db, grad, True)  # measured now; the replay consumes the buffers
            else:
                _hand_over(ctx.weight_consumer, dw, db, grad, retain)
            dw = db = None
        out = []
        # the usual upstream gradient of a loss is exactly 1.0: skip a pass over dW (free to check on CPU only)
        unit = not retain and not grad.is_cuda and grad.numel() == 1 and float(grad) == 1.0
        for g, dtype in zip((dx, dw, db), ctx.dtypes, strict=True):
            if g is not None:
                if not unit:
                    g = g * grad.to(g.dtype) if retain else g.mul_(grad.to(g.dtype))
                g = g if g.dtype == dtype else g.to(dtype)
            out.append(g)
        return (*out, None, None, None, None, None, None, None, None)


def _defer(consumer: Any, fn: Any, *args: Any) -> bool:
    """Whether ``consumer`` (a FORGE optimizer recording its clipping norm pass) keeps ``fn(*args)``, the walk that
    delivers the blocks, to replay once the norm is known: then the blocks delivered now are only measured."""
    defer = getattr(consumer, "defer", None)
    return bool(defer is not None and defer(fn, *args))


def _keeping(consumer: Any, kept: list) -> Any:
    """``consumer``, also appending every ``(v0, v1, dW block, db block)`` it receives to ``kept``."""
    def keep_and_consume(v0: int, v1: int, dw: Tensor, db: Tensor | None) -> None:
        kept.append((v0, v1, dw, db))
        consumer(v0, v1, dw, db)

    return keep_and_consume


def _feed(consumer: Any, blocks: list) -> None:
    for block in blocks:
        consumer(*block)


def _hand_over(consumer: Any, dw: Tensor, db: Tensor | None, grad: Tensor, retain: bool) -> None:
    """Give a weight (and bias) gradient held since forward to ``consumer`` in blocks of vocabulary rows (~4 MiB
    each; 64 MiB on a GPU, where each block is a kernel launch), scaled by the loss's incoming gradient; the blocks
    are scaled in place unless the buffers must survive."""
    rows = max(1, ((64 if dw.is_cuda else 4) << 20) // max(4 * dw.shape[1], 1))

    def scaled(t: Tensor) -> Tensor:
        return t * grad.to(t.dtype) if retain else t.mul_(grad.to(t.dtype))

    for v0 in range(0, dw.shape[0], rows):
        v1 = min(v0 + rows, dw.shape[0])
        consumer(v0, v1, scaled(dw[v0:v1]), None if db is None else scaled(db[v0:v1]))


class ChunkedHeadStats(torch.autograd.Function):
    """Per-token ``(lse, z_target, entropy, mean_z, Σp², target_is_top1)`` with a recompute-in-backward gradient
    for any use of the first four (the last two are non-differentiable diagnostics)."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, ep, chunks, need_entropy, need_zmean, accum_dtype,
                weight_consumer=None, need_diagnostics=False):
        ctx.weight_consumer = weight_consumer
        fwd_chunk, chunk = chunks  # tokens per chunk forward and backward (_stats_chunks)
        st = head_impl(hidden.device, weight.dtype).head_stats(hidden, weight, bias, targets, ep, chunk_size=fwd_chunk,
                                                 need_entropy=need_entropy, need_zmean=need_zmean,
                                                 need_sumsq=need_diagnostics, need_top1=need_diagnostics)
        ctx.save_for_backward(hidden, weight, bias, targets, st.lse, st.entropy)
        ctx.cfg = (ep, chunk, accum_dtype, weight.shape[0])
        ctx.set_materialize_grads(False)
        # Outputs not asked for are empty placeholders without gradient.
        outs = [o if o is not None else hidden.new_empty(0, dtype=torch.float32)
                for o in (st.lse, st.target, st.entropy, st.zmean, st.sumsq, st.top1)]
        ctx.mark_non_differentiable(*[o for o in outs[:4] if o.numel() == 0 and st.lse.numel() != 0], *outs[4:])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, g_lse, g_zt, g_ent, g_zmean, _g_sumsq=None, _g_top1=None):
        _refuse_create_graph()
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        ep, chunk, accum_dtype, vocab = ctx.cfg
        need = ctx.needs_input_grad
        if not (need[0] or need[1] or need[2]):
            return (None,) * 11
        g_ent = g_ent if ent is not None else None
        zero = torch.zeros_like(lse)
        alpha = g_lse.to(lse.dtype) if g_lse is not None else zero
        beta = None
        if g_ent is not None:  # dH/dz_j = -p_j (log p_j + H)
            g_ent = g_ent.to(lse.dtype)
            alpha = alpha - g_ent * ent
            beta = -g_ent
        gamma = None if g_zt is None else g_zt.to(lse.dtype)
        delta = None if g_zmean is None or g_zmean.numel() == 0 else g_zmean.to(lse.dtype) / vocab
        if need[1] and _consumes(ctx.weight_consumer, ctx):
            # the weight gradient goes to the consumer one vocabulary block at a time; autograd gets None for it
            consumer = ctx.weight_consumer
            kept = [] if getattr(consumer, "keep", None) is not None and consumer.keep() else None
            walk = head_impl(hidden.device, weight.dtype).head_backward_vocab_blocks
            args = (hidden, weight, bias, targets, lse, ep, alpha, beta, gamma, delta,
                    consumer if kept is None else _keeping(consumer, kept))
            dx, _ = walk(*args, need_dx=need[0], need_db=bias is not None and need[2])
            if kept is not None:  # a replay re-feeds the blocks (each a fresh tensor) instead of walking again
                _defer(consumer, _feed, consumer, kept)
            else:
                _defer(consumer, functools.partial(walk, need_dx=False, need_db=bias is not None and need[2]), *args)
            return dx, None, None, None, None, None, None, None, None, None, None
        dx, dw, db = head_impl(hidden.device, weight.dtype).head_backward(
            hidden, weight, bias, targets, lse, ep, alpha, beta, gamma, delta,
            chunk_size=chunk, need_dx=need[0], need_dw=need[1], need_db=bias is not None and need[2],
            accum_dtype=accum_dtype,
        )
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None
