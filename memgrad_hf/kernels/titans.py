"""Titans neural memory: the memory MLP's forward and its exact inner gradient, written by hand.

The memory model (as in Titans / titans-pytorch): ``M(x) = LN(MLP(x)) * (gamma + 1) + x`` with a bias-free MLP of
depth 1-4 (``Z_0 = x W_0``, ``A_i = act(Z_{i-1})``, ``Z_i = A_i W_i``), a LayerNorm without affine parameters
(eps 1e-5), and the inner loss ``L = sum_t lr_t * mean_d (M(k_t) - v_t)^2``.

:func:`memory_step` computes, for one chunk, the retrieval ``M(q)`` and the gradient of ``L`` with respect to every
memory weight and ``gamma``, as plain batched ops (3L-1 bmm for the gradient): no ``torch.func``, so it works under
non-reentrant activation checkpointing and ``torch.compile(fullgraph=True)``, and autograd differentiates through it
(the outer gradients to keys, values, learning rates and the weights are exact second-order terms).
:func:`memory_step_autograd` is the ``torch.func.vmap(grad(...))`` reference with the same signature.

Shapes: ``G`` independent memories (batch x heads), chunk of ``C`` tokens, head width ``D``. A weight is either
``(G, d_in, d_out)`` or a shared ``(d_in, d_out)`` (the initial weights, not copied per memory); ``gamma`` is
``(G, D)`` or ``(D,)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LN_EPS = 1e-5
ACTIVATIONS = ("gelu", "silu")


def _act(z: Tensor, activation: str) -> Tensor:
    return F.gelu(z) if activation == "gelu" else F.silu(z)


def _act_backward(grad: Tensor, z: Tensor, activation: str) -> Tensor:
    if activation == "gelu":  # aten's own kernel: bit-identical to autograd's, and twice differentiable
        return torch.ops.aten.gelu_backward(grad, z)
    s = torch.sigmoid(z)  # aten.silu_backward has no double backward
    return grad * s * (1 + z * (1 - s))


def _batched(w: Tensor, g: int) -> Tensor:
    return w if w.dim() == 3 else w.expand(g, *w.shape)


def _mlp(weights: list[Tensor], x: Tensor, activation: str) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """``MLP(x)``, the pre-activations ``Z_0..Z_{L-2}`` and each layer's input ``A_0 = x, A_1..A_{L-1}``."""
    zs: list[Tensor] = []
    acts: list[Tensor] = [x]
    h = x
    for i, w in enumerate(weights):
        if i > 0:
            zs.append(h)
            h = _act(h, activation)
            acts.append(h)
        h = torch.matmul(h, w)  # a shared 2-D weight becomes one GEMM over all memories
    return h, zs, acts


def mlp_forward(weights: list[Tensor], x: Tensor, activation: str) -> tuple[Tensor, list[Tensor]]:
    """``MLP(x)`` and the pre-activations ``Z_0..Z_{L-2}`` (what the backward needs besides ``x``)."""
    m, zs, _ = _mlp(weights, x, activation)
    return m, zs


def memory_forward(weights: list[Tensor], gamma: Tensor, x: Tensor, activation: str) -> Tensor:
    """``M(x) = LN(MLP(x)) * (gamma + 1) + x`` for ``x`` of shape ``(G, T, D)``."""
    m, _, _ = _mlp(weights, x, activation)
    g = gamma if gamma.dim() == 1 else gamma[:, None, :]
    return torch.addcmul(x, F.layer_norm(m, m.shape[-1:], eps=LN_EPS), g + 1)


def memory_step(
    weights: list[Tensor],
    gamma: Tensor,
    keys: Tensor,
    values: Tensor,
    lr: Tensor,
    queries: Tensor | None = None,
    activation: str = "gelu",
) -> tuple[list[Tensor], Tensor, Tensor | None, Tensor]:
    """One chunk of the memory: inner gradients at the given weights, and the retrieval for ``queries``.

    Args:
        weights: L memory weights, ``(G, d_in, d_out)`` or shared ``(d_in, d_out)``.
        gamma: LayerNorm gain offset, ``(G, D)`` or ``(D,)``.
        keys, values: ``(G, C, D)``.
        lr: per-token loss weights (the adaptive learning rate), ``(G, C)``.
        queries: ``(G, Cq, D)`` to retrieve with the same weights, or ``None``.
        activation: ``"gelu"`` (exact erf) or ``"silu"``.

    Returns:
        ``(weight_grads, gamma_grad, retrieved, token_loss)``: gradients of ``sum_t lr_t * mean_d (M(k_t)-v_t)^2``
        with the shapes ``(G, d_in, d_out)`` and ``(G, D)``; ``M(queries)`` or ``None``; the unweighted per-token
        loss ``(G, C)``.

    Example::

        grads, dgamma, retrieved, _ = memory_step([w0, w1], gamma, k, v, lr, queries=q)
    """
    D = keys.shape[-1]
    # Keys and queries go through the MLP separately: concatenating them would cost a copy of both, slices of every
    # intermediate, and a zero-filled buffer per slice in the backward -- more than the larger GEMM saves.
    m, zs, acts = _mlp(weights, keys, activation)
    h, mean, rstd = torch.ops.aten.native_layer_norm(m, [D], None, None, LN_EPS)
    g1 = (gamma if gamma.dim() == 1 else gamma[:, None, :]) + 1
    diff = torch.addcmul(keys - values, h, g1)  # M(k) - v
    token_loss = diff.pow(2).mean(-1)
    dy = diff * (lr * (2.0 / D))[..., None]
    dgamma = (dy * h).sum(1)
    # LayerNorm backward (input grad only) from the forward's statistics.
    dm = torch.ops.aten.native_layer_norm_backward(dy * g1, m, [D], mean, rstd, None, None, [True, False, False])[0]
    grads: list[Tensor] = [None] * len(weights)  # type: ignore[list-item]
    gi = dm
    for i in range(len(weights) - 1, -1, -1):
        grads[i] = torch.bmm(acts[i].transpose(1, 2), gi)
        if i > 0:  # a shared 2-D weight: one GEMM over all memories, no expanded copy
            gi = _act_backward(torch.matmul(gi, weights[i].transpose(-1, -2)), zs[i - 1], activation)
    retrieved = None if queries is None else memory_forward(weights, gamma, queries, activation)
    return grads, dgamma, retrieved, token_loss


def _chunk_loss(weights: tuple[Tensor, ...], gamma: Tensor, keys: Tensor, values: Tensor, lr: Tensor,
                activation: str) -> tuple[Tensor, Tensor]:
    y = memory_forward(list(weights), gamma, keys[None], activation)[0]
    token_loss = (y - values).pow(2).mean(-1)
    return (token_loss * lr).sum(), token_loss


def memory_step_autograd(
    weights: list[Tensor],
    gamma: Tensor,
    keys: Tensor,
    values: Tensor,
    lr: Tensor,
    queries: Tensor | None = None,
    activation: str = "gelu",
) -> tuple[list[Tensor], Tensor, Tensor | None, Tensor]:
    """:func:`memory_step` computed with ``torch.func.vmap(grad(...))`` (the reference; same signature)."""
    G = keys.shape[0]
    ws = tuple(_batched(w, G) for w in weights)
    gam = gamma if gamma.dim() == 2 else gamma.expand(G, -1)
    per_memory = torch.func.vmap(torch.func.grad(_chunk_loss, argnums=(0, 1), has_aux=True),
                                 in_dims=(0, 0, 0, 0, 0, None))
    (gw, gg), token_loss = per_memory(ws, gam, keys, values, lr, activation)
    retrieved = None if queries is None else memory_forward(weights, gamma, queries, activation)
    return list(gw), gg, retrieved, token_loss
