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
        dt = compute_dtype or weight.dtype
        xc = x if x.dtype == dt else x.to(dt)
        wc = weight if weight.dtype == dt else weight.to(dt)
        bc = None if bias is None else (bias if bias.dtype == dt else bias.to(dt))
        if bc is None or xc.dim() == 2:
            out = F.linear(xc, wc, bc)
        else:  # F.linear would return a view of a 2-D addmm: an in-place op on it (roc_bert) is refused in a Function
            out = xc.new_empty(*xc.shape[:-1], wc.shape[0])
            torch.addmm(bc, xc.reshape(-1, xc.shape[-1]), wc.t(), out=out.view(-1, wc.shape[0]))
        ctx.save_for_backward(xc)
        # the parameters themselves, not saved copies: under non-reentrant checkpointing saved tensors come back as
        # recomputed aliases, and the optimizer finds a weight's state and group by the Parameter object
        ctx.weight, ctx.bias, ctx.opt, ctx.dt = weight, bias, opt, dt
        return out

    @staticmethod
    def backward(ctx: Any, dy: Tensor):
        # runs once per layer and step; on a GPU at small batch the host's time per layer is the step's time, so
        # no op that is a no-op here (a reshape of a 2-D tensor, a cast to the same dtype) is issued
        ctx.done = True  # (read by the optimizer's _note_use)
        _refuse_create_graph()
        (x,) = ctx.saved_tensors
        weight, bias, dt = ctx.weight, ctx.bias, ctx.dt
        needs = ctx.needs_input_grad
        dx = None
        if needs[0]:  # before the weight changes
            dx = dy @ (weight if weight.dtype == dt else weight.to(dt))
            if dx.dtype != x.dtype:
                dx = dx.to(x.dtype)
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        db = None
        if bias is not None and needs[2]:
            db = dy2.sum(0).to(bias.dtype)
        dw = None
        if needs[1]:
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            # returned to autograd where its gradient has other parts (autograd sums them, the hook applies), and
            # where this backward does not accumulate into the weight (torch.autograd.grad, backward(inputs=...))
            if weight in ctx.opt._shared or not accumulates_into(ctx, 1):
                dw = (dy2.t() @ x2).to(weight.dtype)
            else:
                ctx.opt._linear_weight_backward(weight, dy2, x2)
        return dx, dw, db, None, None


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
        _refuse_create_graph()
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        if weight in ctx.opt._shared or not accumulates_into(ctx, 1):  # (see ForgeLinearFunction.backward)
            pad = -1 if ctx.padding_idx is None else ctx.padding_idx
            dw = torch.ops.aten.embedding_dense_backward(dy.to(weight.dtype), ids, weight.shape[0], pad, False)
            return None, dw, None, None
        ctx.opt._embedding_weight_backward(weight, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]), ctx.padding_idx)
        return None, None, None, None
