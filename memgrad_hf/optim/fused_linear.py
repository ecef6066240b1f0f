"""The linear layer whose backward applies the optimizer step to its weight, tile by tile.

``dX = dY·W`` is computed first (with the old weight), then ``dW`` is produced one row block at a time and each
block is handed to the optimizer's element-wise rule at once: the weight gradient never exists as a tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


class ForgeLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, opt: Any, compute_dtype: Any):
        dt = compute_dtype or weight.dtype
        xc = x if x.dtype == dt else x.to(dt)
        wc = weight if weight.dtype == dt else weight.to(dt)
        bc = None if bias is None else (bias if bias.dtype == dt else bias.to(dt))
        out = F.linear(xc, wc, bc)
        ctx.save_for_backward(xc, weight, bias)
        ctx.opt, ctx.dt = opt, dt
        return out

    @staticmethod
    def backward(ctx: Any, dy: Tensor):
        x, weight, bias = ctx.saved_tensors
        opt, dt = ctx.opt, ctx.dt
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dx = None
        if ctx.needs_input_grad[0]:  # before the weight changes
            wc = weight if weight.dtype == dt else weight.to(dt)
            dx = (dy2 @ wc).reshape(*dy.shape[:-1], weight.shape[1]).to(x.dtype)
        db = None
        if bias is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(bias.dtype)
        if ctx.needs_input_grad[1]:
            opt._linear_weight_backward(weight, dy2, x2)
        return dx, None, db, None, None
