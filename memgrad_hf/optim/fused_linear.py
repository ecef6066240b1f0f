"""Linear and embedding layers whose backward applies the optimizer step to their weight, tile by tile.

``dX = dY·W`` is computed first (with the old weight), then ``dW`` is produced one row block at a time and each
block is handed to the optimizer's element-wise rule at once: the weight gradient never exists as a tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from memgrad_hf.engine import accumulates_into, refuse_create_graph


def _refuse_create_graph() -> None:
    refuse_create_graph("a layer whose FORGE optimizer step runs inside backward (the step cannot be differentiated)",
                        "Use a torch optimizer (e.g. optim='adamw_torch') for this training.")


class ForgeLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, opt: Any, compute_dtype: Any):
        out, xc, dt = linear_forward(x, weight, bias, compute_dtype)
        ctx.save_for_backward(xc)
        # the parameters themselves, not saved copies: under non-reentrant checkpointing saved tensors come back as
        # recomputed aliases, and the optimizer finds a weight's state and group by the Parameter object
        ctx.weight, ctx.bias, ctx.opt, ctx.dt = weight, bias, opt, dt
        return out

    @staticmethod
    def backward(ctx: Any, dy: Tensor):
        ctx.done = True  # (read by the optimizer's _note_use)
        (x,) = ctx.saved_tensors
        needs = ctx.needs_input_grad
        db_dtype = ctx.bias.dtype if ctx.bias is not None and needs[2] else None
        dx, dw, db = linear_backward(ctx.opt, dy, x, ctx.weight, db_dtype, ctx.dt, needs[0], needs[1],
                                     lambda: accumulates_into(ctx, 1))
        return dx, dw, db, None, None


def linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None, compute_dtype: Any) -> tuple[Tensor, Tensor, Any]:
    """The layer's output in ``compute_dtype`` (autocast's; None: the weight's), the input as backward needs it
    (cast to that dtype) and the dtype."""
    dt = compute_dtype or weight.dtype
    xc = x if x.dtype == dt else x.to(dt)
    wc = weight if weight.dtype == dt else weight.to(dt)
    bc = None if bias is None else (bias if bias.dtype == dt else bias.to(dt))
    if bc is None or xc.dim() == 2:
        out = F.linear(xc, wc, bc)
    else:  # F.linear would return a view of a 2-D addmm: an in-place op on it (roc_bert) is refused in a Function
        out = xc.new_empty(*xc.shape[:-1], wc.shape[0])
        torch.addmm(bc, xc.reshape(-1, xc.shape[-1]), wc.t(), out=out.view(-1, wc.shape[0]))
    return out, xc, dt


def linear_backward(opt: Any, dy: Tensor, x: Tensor, weight: Tensor, db_dtype: Any, dt: Any, need_dx: bool,
                    need_dw: bool, accumulates: Any) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dX, dW, db)`` of a fused layer, ``dX`` computed before the optimizer updates the weight from ``dW``'s
    tiles (``db`` in ``db_dtype``; None: not wanted). ``dW`` is returned only where the update cannot run here: a
    weight whose gradient has other parts (``opt._shared``: summed first, then applied once) or a backward that does
    not accumulate into it (``accumulates()`` false: ``torch.autograd.grad``, ``backward(inputs=...)``). Shared by the
    eager Function and the compiled path's operator (:mod:`memgrad_hf.optim.forge_ops`)."""
    # runs once per layer and step; on a GPU at small batch the host's time per layer is the step's time, so
    # no op that is a no-op here (a reshape of a 2-D tensor, a cast to the same dtype) is issued
    _refuse_create_graph()
    dx = None
    if need_dx:  # before the weight changes
        dx = dy @ (weight if weight.dtype == dt else weight.to(dt))
        if dx.dtype != x.dtype:
            dx = dx.to(x.dtype)
    dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
    db = None if db_dtype is None else dy2.sum(0).to(db_dtype)
    dw = None
    if need_dw:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if not accumulates() or weight in opt._shared:  # (no optimizer where nothing accumulates: forge_ops)
            dw = (dy2.t() @ x2).to(weight.dtype)
        else:
            opt._linear_weight_backward(weight, dy2, x2)
    return dx, dw, db


class ForgeEmbeddingFunction(torch.autograd.Function):
    """``F.embedding`` whose backward builds the (dense) weight gradient one row block at a time from the
    looked-up rows and applies the update to each block at once."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, weight: Tensor, padding_idx: int | None, opt: Any):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx, ctx.opt = weight, padding_idx, opt
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, dy: Tensor):
        ctx.done = True
        (ids,) = ctx.saved_tensors
        dw = embedding_backward(ctx.opt, dy, ids, ctx.weight, ctx.padding_idx, lambda: accumulates_into(ctx, 1))
        return None, dw, None, None


def embedding_backward(opt: Any, dy: Tensor, ids: Tensor, weight: Tensor, padding_idx: int | None,
                       accumulates: Any) -> Tensor | None:
    """The fused embedding's update from ``dy``; its dense weight gradient is returned instead where the update
    cannot run here (as :func:`linear_backward`'s ``dW``)."""
    _refuse_create_graph()
    if not accumulates() or weight in opt._shared:
        pad = -1 if padding_idx is None else padding_idx
        return torch.ops.aten.embedding_dense_backward(dy.to(weight.dtype), ids, weight.shape[0], pad, False)
    opt._embedding_weight_backward(weight, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]), padding_idx)
    return None
