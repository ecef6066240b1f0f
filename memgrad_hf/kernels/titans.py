"""Titans neural memory: the memory MLP's forward and its exact inner gradient, written by hand.

The memory model (as in Titans / titans-pytorch): ``M(x) = LN(MLP(x)) * (gamma + 1) + x`` with a bias-free MLP of
depth 1-4 (``Z_0 = x W_0``, ``A_i = act(Z_{i-1})``, ``Z_i = A_i W_i``), a LayerNorm without affine parameters
(eps 1e-5), and the inner loss ``L = sum_t lr_t * mean_d (M(k_t) - v_t)^2``.

:func:`memory_step` computes, for one chunk, the retrieval ``M(q)`` and the gradient of ``L`` with respect to every
memory weight and ``gamma``, as plain batched ops (3L-1 bmm for the gradient): no ``torch.func``, so it works under
non-reentrant activation checkpointing and ``torch.compile(fullgraph=True)``. Its outer backward (the gradients to
keys, values, learning rates, queries, gamma and the weights: exact second-order terms of the inner loss) is written
by hand too (:class:`_MemoryStep`): it saves ~3x fewer bytes per chunk than autograd through the plain ops and runs
fewer elementwise passes; it is itself differentiable (double backward recomputes through the plain ops).
:func:`memory_step_autograd` is the ``torch.func.vmap(grad(...))`` reference with the same signature.

Backward of the step (per memory; ``R_i``, ``R_gamma``, ``R_r`` the incoming gradients of ``dW_i``, ``dgamma`` and
``M(q)``; ``G_i`` the inner gradient at layer ``i``'s output, ``E_i = G_i W_i^T``):

- chain: ``Gbar_i = A_i R_i + Ebar_i W_i``, ``Ebar_{i+1} = Gbar_i * act'(Z_i)``;
- LayerNorm backward ``dM = LNb(dyg)`` is self-adjoint in ``dyg``: ``dygbar = LNb(Gbar_{L-1})``, plus its
  dependence on ``M`` through ``h`` and ``rstd`` (row-wise closed form below);
- loss: ``diffbar = s * dybar``, ``lrbar = (2/D) sum_d dybar * diff``, ``vbar = -diffbar``;
- MLP: ``Zbar_{i-1} = act'(Z_{i-1}) * Abar_i + act''(Z_{i-1}) * Gbar_{i-1} * E_i``,
  ``Wbar_i = A_i^T Zbar_i + Ebar_i^T G_i``, ``Abar_i = Zbar_i W_i^T + G_i R_i^T``.

Shapes: ``G`` independent memories (batch x heads), chunk of ``C`` tokens, head width ``D``. A weight is either
``(G, d_in, d_out)`` or a shared ``(d_in, d_out)`` (the initial weights, not copied per memory); ``gamma`` is
``(G, D)`` or ``(D,)``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

LN_EPS = 1e-5
# The memory's RMS norms: a fixed epsilon, not the dtype's (nn.RMSNorm's default), which in bf16 (7.8e-3) swamps
# the mean square of small hidden states (bf16 memories were 0.53 off fp32 at rms 0.01; the same eps in every dtype).
NORM_EPS = 1e-6
ACTIVATIONS = ("gelu", "silu")
_INV_SQRT_2PI = 0.3989422804014327
_ROWS = sys.modules[__name__]  # this module's row ops (ln_loss_grad, ln_residual, their backwards): the default


def apply_activation(z: Tensor, activation: str) -> Tensor:
    """The memory MLP's activation, ``"gelu"`` or ``"silu"`` (shared with the FAN's prediction)."""
    return F.gelu(z) if activation == "gelu" else F.silu(z)


def activation_backward(grad: Tensor, z: Tensor, activation: str) -> Tensor:
    """``grad * act'(z)``: the backward of :func:`apply_activation` at the pre-activation ``z``."""
    if activation == "gelu":  # aten's own kernel: bit-identical to autograd's, and twice differentiable
        return torch.ops.aten.gelu_backward(grad, z)
    s = torch.sigmoid(z)  # aten.silu_backward has no double backward
    return grad * s * (1 + z * (1 - s))


def _matmul(a: Tensor, w: Tensor) -> Tensor:
    """``a @ w`` for ``a`` ``(G, T, d_in)``: ``bmm`` for a per-memory weight (``matmul`` would wrap it in four view
    ops and a copy-free reshape, each a dispatch on a launch-bound GPU step), one GEMM over all memories for a shared
    2-D weight."""
    return torch.bmm(a, w) if w.dim() == 3 else torch.matmul(a, w)


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
            h = apply_activation(h, activation)
            acts.append(h)
        h = _matmul(h, w)
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


def _g1(gamma: Tensor) -> Tensor:
    return (gamma if gamma.dim() == 1 else gamma[:, None, :]) + 1


def _ln_backward(grad: Tensor, m: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    """Input gradient of the affine-free LayerNorm (aten's kernel, from the forward's statistics)."""
    return torch.ops.aten.native_layer_norm_backward(grad, m, [m.shape[-1]], mean, rstd, None, None,
                                                     [True, False, False])[0]


def ln_loss_grad(m: Tensor, keys: Tensor, values: Tensor, lr: Tensor, gamma: Tensor, save: bool = False,
                 return_loss: bool = False) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, ...] | None]:
    """The row ops between the key path's last GEMM and its first gradient GEMM.

    From the memory MLP's output ``m`` on the keys ``(G, C, D)``: ``h = LN(m)``, ``diff = h*(gamma+1) + k - v``, the
    loss gradient ``dy = (2/D) lr diff``, ``dgamma = sum_t dy*h`` ``(G, D)`` and ``dm = LNb(dy*(gamma+1))``.

    Returns:
        ``(dm, dgamma, token_loss, saved)``: ``token_loss = mean_d diff^2`` ``(G, C)`` if ``return_loss`` else
        ``None``; ``saved = (h, mean, rstd, diff)`` (``mean``/``rstd`` ``(G, C, 1)``) if ``save`` else ``None``.
        :mod:`memgrad_hf.kernels.titans_rows_triton` has the same function in one launch.
    """
    D = m.shape[-1]
    g1 = _g1(gamma)
    h, mean, rstd = torch.ops.aten.native_layer_norm(m, [D], None, None, LN_EPS)
    diff = torch.addcmul(keys - values, h, g1)  # M(k) - v
    token_loss = diff.pow(2).mean(-1) if return_loss else None  # two launches a chunk the memory layer skips
    dy = diff * (lr * (2.0 / D))[..., None]
    dgamma = (dy * h).sum(1)
    dm = _ln_backward(dy * g1, m, mean, rstd)
    return dm, dgamma, token_loss, ((h, mean, rstd, diff) if save else None)


def ln_residual(m: Tensor, x: Tensor, gamma: Tensor, save: bool = False,
                ) -> tuple[Tensor, tuple[Tensor, ...] | None]:
    """The retrieval's row ops: ``LN(m) * (gamma + 1) + x`` for the MLP output ``m`` on the queries ``x``.

    Returns ``(out, saved)`` with ``saved = (h, mean, rstd)`` if ``save`` else ``None``; same function in
    :mod:`memgrad_hf.kernels.titans_rows_triton`.
    """
    h, mean, rstd = torch.ops.aten.native_layer_norm(m, [m.shape[-1]], None, None, LN_EPS)
    return torch.addcmul(x, h, _g1(gamma)), ((h, mean, rstd) if save else None)


def ln_residual_backward(r: Tensor, m: Tensor, h: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor,
                         ) -> tuple[Tensor, Tensor]:
    """Backward of :func:`ln_residual` for the incoming gradient ``r`` of its output: ``(m_bar, g1_bar)`` with
    ``g1_bar = sum_t r * h`` ``(G, D)`` (the residual's own gradient, ``r``, is the caller's)."""
    return _ln_backward(r * _g1(gamma), m, mean, rstd), (r * h).sum(1)


def ln_loss_backward(w: Tensor | None, m: Tensor, h: Tensor, mean: Tensor, rstd: Tensor, diff: Tensor, lr: Tensor,
                     gamma: Tensor, r_gamma: Tensor | None, r_loss: Tensor | None, differentiable: bool = False,
                     ) -> tuple[Tensor | None, ...]:
    """Backward of :func:`ln_loss_grad` (the outer gradient's row ops), from the incoming gradients of ``dm``
    (``w``), ``dgamma`` (``r_gamma``, ``(G, D)``) and the token loss (``r_loss``, ``(G, C)``), any of them None.

    Returns ``(m_bar, k_bar, v_bar, lr_bar, g1_bar)`` (None where nothing flows): ``k_bar = -v_bar = diff_bar``,
    ``g1_bar`` ``(G, D)``. ``differentiable``: under double backward, ``rstd`` is recomputed from ``m`` with a graph.
    :mod:`memgrad_hf.kernels.titans_rows_triton` has the same function in one launch (no autograd).
    """
    D = m.shape[-1]
    g1 = _g1(gamma)
    s = (lr * (2.0 / D))[..., None]
    dy = diff * s
    u = dy * g1  # dyg
    mbar = dybar = dygbar = hbar = diffbar = lrbar = g1bar = None
    if w is not None:
        dygbar = _ln_backward(w, m, mean, rstd)  # the LayerNorm backward is its own adjoint in dyg
        dybar = dygbar * g1
        # dM = r (u - mean(u) - h mean(u h)) also depends on M through h and r: with T = w.u - sum(u) sum(w)/D
        # - (w.h)(u.h)/D, dr/dM = -r^2 h/D and dh/dM = r (I - 1/D - h h^T/D), the row's M gradient is
        # (r^2/D) [((w.h) sum(u) + (u.h) sum(w))/D - (w.h) u - (u.h) w + h (-T + 2 (w.h)(u.h)/D)].
        sw, su = w.sum(-1, keepdim=True), u.sum(-1, keepdim=True)
        wu, wh, uh = (w * u).sum(-1, keepdim=True), (w * h).sum(-1, keepdim=True), (u * h).sum(-1, keepdim=True)
        coef_h = su * sw / D + 3 * wh * uh / D - wu
        # (aten's rstd carries no graph: under double backward take it from differentiable ops)
        r = torch.rsqrt(m.var(-1, correction=0, keepdim=True) + LN_EPS) if differentiable else rstd
        mbar = (r * r / D) * ((wh * su + uh * sw) / D - wh * u - uh * w + h * coef_h)
    if r_gamma is not None:  # dgamma = sum_t dy * h
        rg = r_gamma[:, None, :]
        dybar = _add(dybar, rg * h)
        hbar = rg * dy
    if dybar is not None:
        diffbar = dybar * s
        lrbar = (dybar * diff).sum(-1) * (2.0 / D)
    if r_loss is not None:  # token_loss = mean_d diff^2
        diffbar = _add(diffbar, diff * (r_loss[..., None] * (2.0 / D)))
    if diffbar is not None:
        hbar = _add(hbar, diffbar * g1)
        g1bar = (diffbar * h if dygbar is None else torch.addcmul(diffbar * h, dygbar, dy)).sum(1)
    if hbar is not None:
        mbar = _add(mbar, _ln_backward(hbar, m, mean, rstd))
    return mbar, diffbar, (None if diffbar is None else -diffbar), lrbar, g1bar


def _rows_impl(x: Tensor):
    """The row ops for a step that autograd does not trace, on ``x``'s device: the Triton twin's one launch each on a
    GPU (the step there is bound by launches: ~20 ops for ~1 GFLOP), this module's torch ops elsewhere. Under
    ``torch.compile`` the torch ops, which inductor fuses itself."""
    if x.device.type != "cuda" or x.dtype != torch.float32 or torch.compiler.is_compiling():
        return _ROWS
    from memgrad_hf import kernels

    if kernels.default_backend("titans", x.device) != "triton":
        return _ROWS
    from memgrad_hf.kernels import titans_rows_triton

    return titans_rows_triton


# Where a step has no backward to serve, the whole-step Triton kernel (kernels.titans_triton: one program per memory,
# one launch) beats the batched GEMMs' ~12 launches at head width <= 64 and MLP width <= 256 on an H100: 0.33-0.34
# against 0.40-0.42 ms at best (0.45-0.59 median) at B=8 and B=48, D=64, H=256; at D=128, H=512 its program's tiles
# no longer fit and it takes 1.30 against 0.39 ms (benchmarks/RESULTS.md, 2026-11-22 and 2026-11-27).
_WHOLE_STEP_MAX_D, _WHOLE_STEP_MAX_H = 64, 256


def _inference_step(weights: list[Tensor], gamma: Tensor, keys: Tensor, values: Tensor, lr: Tensor,
                    queries: Tensor | None) -> Callable | None:
    """The whole-step Triton ``memory_step`` for an inference step where it is the faster one (see above), else
    None: on a GPU whose Titans row kernels run (``_rows_impl``), fp32, depth <= 4, ``D <= 64``, widths <= 256."""
    if (_rows_impl(keys) is _ROWS or keys.numel() == 0 or (queries is not None and queries.shape[1] == 0)
            or torch.is_autocast_enabled(keys.device.type)):  # (autocast would run the torch step's GEMMs in bf16)
        return None
    tensors = (*weights, gamma, keys, values, lr, *(() if queries is None else (queries,)))
    if (len(weights) > 4 or keys.shape[-1] > _WHOLE_STEP_MAX_D or any(t.dtype != torch.float32 for t in tensors)
            or any(max(w.shape[-2:]) > _WHOLE_STEP_MAX_H for w in weights)):
        return None
    from memgrad_hf.kernels import titans_triton

    return titans_triton.memory_step


def _step_forward(weights: list[Tensor], gamma: Tensor, keys: Tensor, values: Tensor, lr: Tensor,
                  queries: Tensor | None, activation: str, save: bool = True, return_loss: bool = True,
                  rows=None) -> tuple[tuple[Tensor | None, ...], dict]:
    """The step's outputs ``(*grads, dgamma, token_loss, retrieved?)`` (``token_loss`` None unless ``return_loss``)
    and (``save``) what its backward needs. ``rows``: the module whose :func:`ln_loss_grad` / :func:`ln_residual`
    run the row ops (this one, or its Triton twin); autograd can only go through this module's.

    Temporaries are dropped as soon as they are used (the peak of one step is a few ``(G, C, H)`` tensors), and the
    retrieval runs first so that its activations are gone before the key path allocates its own.
    """
    rows = _ROWS if rows is None else rows
    saved: dict = {}
    retrieved = None
    if queries is not None:
        # Keys and queries go through the MLP separately: concatenating them would cost a copy of both and slices of
        # every intermediate, more than the larger GEMM saves.
        mq, zqs, _ = _mlp(weights, queries, activation)
        retrieved, sq = rows.ln_residual(mq, queries, gamma, save)
        if save:
            saved.update(zqs=zqs, mq=mq, hq=sq[0], meanq=sq[1], rstdq=sq[2])
        del mq, zqs, sq
    m, zs, acts = _mlp(weights, keys, activation)
    dm, dgamma, token_loss, sk = rows.ln_loss_grad(m, keys, values, lr, gamma, save, return_loss)
    if save:
        h, mean, rstd, diff = sk
        saved.update(zs=list(zs), m=m, h=h, mean=mean, rstd=rstd, diff=diff, dm=dm)
    del m, sk
    grads: list[Tensor] = [None] * len(weights)  # type: ignore[list-item]
    gi = dm
    for i in range(len(weights) - 1, -1, -1):
        grads[i] = torch.bmm(acts[i].transpose(1, 2), gi)
        acts[i] = None  # type: ignore[call-overload]
        if i > 0:  # a shared 2-D weight: one GEMM over all memories, no expanded copy
            gi = activation_backward(_matmul(gi, weights[i].transpose(-1, -2)), zs[i - 1], activation)
            zs[i - 1] = None  # type: ignore[call-overload]
    outs: tuple[Tensor | None, ...] = (*grads, dgamma, token_loss)
    return (outs if retrieved is None else (*outs, retrieved)), saved


def _act_second(z: Tensor, activation: str, inplace: bool) -> Tensor:
    """``act''(z)``: erf GELU ``pdf(z) (2 - z^2)``; SiLU ``s (1 - s) (2 + z (1 - 2 s))``."""
    if activation == "gelu":
        z2 = z * z
        if inplace:  # two allocations instead of five
            return z2.mul(-0.5).exp_().mul_(_INV_SQRT_2PI).mul_(z2.neg_().add_(2))
        return torch.exp(z2 * -0.5) * _INV_SQRT_2PI * (2 - z2)
    s = torch.sigmoid(z)
    if inplace:
        t = (s * -2).add_(1).mul_(z).add_(2)
        return t.mul_(s).mul_(1 - s)
    return s * (1 - s) * (2 + z * (1 - 2 * s))


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else a + b


def _wgrad(a: Tensor, b: Tensor, shared: bool, acc: Tensor | None, inplace: bool) -> Tensor:
    """``acc + a^T b`` per memory ``(G, d_a, d_b)``, or summed over memories for a shared weight (one GEMM)."""
    if shared:
        a2, b2 = a.reshape(-1, a.shape[-1]).t(), b.reshape(-1, b.shape[-1])
        if acc is None:
            return torch.mm(a2, b2)
        return acc.addmm_(a2, b2) if inplace else torch.addmm(acc, a2, b2)
    if acc is None:
        return torch.bmm(a.transpose(1, 2), b)
    return acc.baddbmm_(a.transpose(1, 2), b) if inplace else torch.baddbmm(acc, a.transpose(1, 2), b)


def _mm(a: Tensor, w: Tensor, acc: Tensor | None, inplace: bool) -> Tensor:
    """``acc + a @ w`` (``w`` per memory or shared); ``inplace`` accumulates into ``acc`` (a fresh temporary)."""
    if acc is None:
        return _matmul(a, w)
    if w.dim() == 3:
        return acc.baddbmm_(a, w) if inplace else torch.baddbmm(acc, a, w)
    if inplace:
        acc.view(-1, acc.shape[-1]).addmm_(a.reshape(-1, a.shape[-1]), w)
        return acc
    return torch.addmm(acc.reshape(-1, acc.shape[-1]), a.reshape(-1, a.shape[-1]), w).view(acc.shape)


def _saved_list(sv: dict, has_q: bool) -> list[Tensor]:
    out = [sv["m"], sv["h"], sv["mean"], sv["rstd"], sv["diff"], sv["dm"], *sv["zs"]]
    if has_q:
        out += [sv["mq"], sv["hq"], sv["meanq"], sv["rstdq"], *sv["zqs"]]
    return out


class _MemoryStep(torch.autograd.Function):
    """:func:`memory_step` with a hand-written backward (the exact second-order terms of the inner loss).

    Autograd through the plain ops saves every intermediate of the step (~10 ``(G, C, H)``-sized tensors per chunk
    at depth 2) and runs generic double-backward formulas (GELU's and LayerNorm's are long op chains). This saves
    only the pre-activations and the ``(G, C, D)`` LayerNorm/loss tensors, recomputes the activations and the
    ``E_i = G_i W_i^T`` products (one GEMM per hidden layer), and frees each temporary after its last use. Its
    backward is made of differentiable ops; under double backward it recomputes the intermediates with their graph.
    """

    @staticmethod
    def forward(ctx, activation: str, n_w: int, has_q: bool, return_loss: bool, *tensors: Tensor,
                ) -> tuple[Tensor | None, ...]:
        weights, (gamma, keys, values, lr) = list(tensors[:n_w]), tensors[n_w:n_w + 4]
        queries = tensors[n_w + 4] if has_q else None
        outs, sv = _step_forward(weights, gamma, keys, values, lr, queries, activation, return_loss=return_loss,
                                 rows=_rows_impl(keys))  # no autograd inside a Function's forward
        ctx.activation, ctx.n_w, ctx.has_q, ctx.device_type = activation, n_w, has_q, keys.device.type
        ctx.save_for_backward(*tensors, *_saved_list(sv, has_q))
        ctx.set_materialize_grads(False)  # outputs without a gradient add no work to the backward
        return outs

    @staticmethod
    def backward(ctx, *bars: Tensor | None) -> tuple[Tensor | None, ...]:
        # A backward run inside an autocast region must not re-cast the step's fp32 math.
        with torch.autocast(ctx.device_type, enabled=False):
            return _MemoryStep._backward(ctx, *bars)

    @staticmethod
    def _backward(ctx, *bars: Tensor | None) -> tuple[Tensor | None, ...]:
        act, L, has_q = ctx.activation, ctx.n_w, ctx.has_q
        st = list(ctx.saved_tensors)
        n_in = L + 4 + int(has_q)
        ws, (gamma, x, values, lr) = st[:L], st[L:L + 4]
        q = st[L + 4] if has_q else None
        # A plain backward accumulates into its own fresh temporaries in place (fewer new pages per chunk); under
        # double backward everything stays out of place, and the intermediates are recomputed so that they carry
        # their graph to the inputs.
        ip = not torch.is_grad_enabled()
        if not ip:
            _, sv = _step_forward(ws, gamma, x, values, lr, q, act)
            st = st[:n_in] + _saved_list(sv, has_q)
        m, h, mean, rstd, diff, dm, *rest = st[n_in:]
        zs, rest = rest[:L - 1], rest[L - 1:]
        R, r_gamma, r_loss = list(bars[:L]), bars[L], bars[L + 1]
        r_q = bars[L + 2] if has_q else None
        shared = [w.dim() == 2 for w in ws]
        wbar: list[Tensor | None] = [None] * L
        g1bar = qbar = None
        # Temporaries are released as soon as they are used (list slots set to None), so one step's backward holds a
        # few (G, C, H) tensors at a time; the retrieval's backward runs first and is gone before the key path starts.
        # 0) Retrieval: M(q) = LN(MLP(q)) * g1 + q.
        if r_q is not None:
            mq, hq, meanq, rstdq, *zqs = rest
            qbar = r_q
            zbar, g1bar = (_rows_impl(x) if ip else _ROWS).ln_residual_backward(r_q, mq, hq, meanq, rstdq, gamma)
            for i in range(L - 1, -1, -1):
                wbar[i] = _wgrad(q if i == 0 else apply_activation(zqs[i - 1], act), zbar, shared[i], None, ip)
                abar = _matmul(zbar, ws[i].transpose(-1, -2))
                if i == 0:
                    qbar = qbar + abar
                else:
                    zbar = activation_backward(abar, zqs[i - 1], act)
            del zbar, abar
        # A_i, recomputed from the pre-activations
        acts: list[Tensor | None] = [x] + [apply_activation(z, act) for z in zs]
        # G_i (the gradient at layer i's output) and E_i = G_i W_i^T, recomputed top-down.
        Gs: list[Tensor | None] = [None] * L
        Es: list[Tensor | None] = [None] * L
        Gs[L - 1] = dm
        for i in range(L - 1, 0, -1):
            Es[i] = _matmul(Gs[i], ws[i].transpose(-1, -2))
            Gs[i - 1] = activation_backward(Es[i], zs[i - 1], act)
        # 1) Through the gradient chain, bottom-up: dW_i = A_i^T G_i and G_{i-1} = (G_i W_i^T) * act'(Z_{i-1}).
        # The curvature term of Z_i (Gbar_i * E_{i+1} * act''(Z_i), for step 3) is formed here, freeing E_{i+1}.
        Ebar: list[Tensor | None] = [None] * L
        curv: list[Tensor | None] = [None] * L
        gb = None
        for i in range(L):
            gb = None if R[i] is None else torch.bmm(acts[i], R[i])
            if Ebar[i] is not None:
                gb = _mm(Ebar[i], ws[i], gb, ip)
            if i < L - 1:
                if gb is not None:
                    Ebar[i + 1] = activation_backward(gb, zs[i], act)
                    if ip:
                        curv[i] = _act_second(zs[i], act, True).mul_(gb).mul_(Es[i + 1])
                    else:
                        curv[i] = gb * Es[i + 1] * _act_second(zs[i], act, False)
                Es[i + 1] = None
        w = gb  # Gbar_{L-1}, the incoming gradient of dM
        # 2) Through the LayerNorm backward dM = LNb(dyg; M) and the loss gradient dy = s (M(k) - v): row ops, one
        # Triton launch on a GPU in a plain backward (a differentiable one keeps the torch ops)
        rows = _rows_impl(x) if ip else _ROWS
        mbar, xbar, vbar, lrbar, g1bar_k = rows.ln_loss_backward(w, m, h, mean, rstd, diff, lr, gamma, r_gamma, r_loss,
                                                                 differentiable=not ip)
        g1bar = _add(g1bar, g1bar_k)
        del w, gb, g1bar_k
        # 3) Back through the MLP forward on the keys (Z_bar of the top layer is M_bar), plus the chain's own terms.
        zbar = mbar
        for i in range(L - 1, -1, -1):
            wb = wbar[i]
            if zbar is not None:
                wb = _wgrad(acts[i], zbar, shared[i], wb, ip)
            if Ebar[i] is not None:
                wb = _wgrad(Ebar[i], Gs[i], shared[i], wb, ip)
            wbar[i], acts[i], Ebar[i] = wb, None, None
            abar = None if zbar is None else _matmul(zbar, ws[i].transpose(-1, -2))
            if R[i] is not None:
                abar = _mm(Gs[i], R[i].transpose(1, 2), abar, ip)
            Gs[i] = None
            if i == 0:
                xbar = _add(xbar, abar)
                break
            zbar = None if abar is None else activation_backward(abar, zs[i - 1], act)
            if curv[i - 1] is not None:
                zbar = curv[i - 1] if zbar is None else (zbar.add_(curv[i - 1]) if ip else zbar + curv[i - 1])
                curv[i - 1] = None
        gbar = None
        if g1bar is not None:
            gbar = g1bar.sum(0) if gamma.dim() == 1 else g1bar
        return (None, None, None, None, *wbar, gbar, xbar, vbar, lrbar, qbar)


class _RMSNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, saving only ``x`` and the per-row ``rsqrt``.

    On CPU ``F.rms_norm`` is a chain of generic ops (and saves their intermediates); this is ~1.5x faster forward +
    backward and saves less. fp32/fp64 only (:func:`rms_norm` falls back to ``F.rms_norm`` otherwise).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        r = torch.rsqrt((x * x).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, r, weight)
        ctx.eps = eps
        y = x * r
        return y if weight is None else y.mul_(weight)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # differentiable ops: double backward
        x, r, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward: rsqrt must carry its graph to x
            r = torch.rsqrt((x * x).mean(-1, keepdim=True) + ctx.eps)
        xh = x * r
        gw = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                gw = (g * xh).sum(tuple(range(g.dim() - 1)))
            g = g * weight
        gx = None
        if ctx.needs_input_grad[0]:
            gx = (g - xh * (g * xh).mean(-1, keepdim=True)) * r
        return gx, gw, None


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float | None = NORM_EPS) -> Tensor:
    """``F.rms_norm(x, x.shape[-1:], weight, eps)`` (``eps=None``: the dtype's epsilon, as ``nn.RMSNorm``)."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if (x.dtype not in (torch.float32, torch.float64) or torch._C._are_functorch_transforms_active()
            or not torch.is_grad_enabled()):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return _RMSNorm.apply(x, weight, eps)


def memory_step(
    weights: list[Tensor],
    gamma: Tensor,
    keys: Tensor,
    values: Tensor,
    lr: Tensor,
    queries: Tensor | None = None,
    activation: str = "gelu",
    *,
    return_loss: bool = True,
) -> tuple[list[Tensor], Tensor, Tensor | None, Tensor | None]:
    """One chunk of the memory: inner gradients at the given weights, and the retrieval for ``queries``.

    Batched GEMMs with the row ops between them (two Triton kernels on a GPU); an inference step (no gradient to
    any input) on a GPU at head width <= 64 and MLP width <= 256 runs as one Triton kernel instead (the faster
    there; same results, ``kernels.titans_triton``).

    Args:
        weights: L memory weights, ``(G, d_in, d_out)`` or shared ``(d_in, d_out)``.
        gamma: LayerNorm gain offset, ``(G, D)`` or ``(D,)``.
        keys, values: ``(G, C, D)``.
        lr: per-token loss weights (the adaptive learning rate), ``(G, C)``.
        queries: ``(G, Cq, D)`` to retrieve with the same weights, or ``None``.
        activation: ``"gelu"`` (exact erf) or ``"silu"``.
        return_loss: also return the per-token loss (else ``None`` in its place: the memory layer does not use it).

    Returns:
        ``(weight_grads, gamma_grad, retrieved, token_loss)``: gradients of ``sum_t lr_t * mean_d (M(k_t)-v_t)^2``
        with the shapes ``(G, d_in, d_out)`` and ``(G, D)``; ``M(queries)`` or ``None``; the unweighted per-token
        loss ``(G, C)`` (differentiable) or ``None``.

    Example::

        grads, dgamma, retrieved, _ = memory_step([w0, w1], gamma, k, v, lr, queries=q)
    """
    L = len(weights)
    tensors = (*weights, gamma, keys, values, lr, *(() if queries is None else (queries,)))
    if torch._C._are_functorch_transforms_active():
        # Under torch.func transforms: plain ops, which autograd and functorch differentiate as they are.
        outs, _ = _step_forward(list(weights), gamma, keys, values, lr, queries, activation, save=False,
                                return_loss=return_loss)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        outs = _MemoryStep.apply(activation, L, queries is not None, return_loss, *tensors)
    else:  # inference: no graph, nothing saved
        whole = _inference_step(list(weights), gamma, keys, values, lr, queries)
        if whole is not None:
            return whole(list(weights), gamma, keys, values, lr, queries, activation, return_loss=return_loss)
        outs, _ = _step_forward(list(weights), gamma, keys, values, lr, queries, activation, save=False,
                                return_loss=return_loss, rows=_rows_impl(keys))
    return list(outs[:L]), outs[L], (outs[L + 2] if queries is not None else None), outs[L + 1]


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
    *,
    return_loss: bool = True,
) -> tuple[list[Tensor], Tensor, Tensor | None, Tensor | None]:
    """:func:`memory_step` computed with ``torch.func.vmap(grad(...))`` (the reference; same signature)."""
    G = keys.shape[0]
    ws = tuple(_batched(w, G) for w in weights)
    gam = gamma if gamma.dim() == 2 else gamma.expand(G, -1)
    per_memory = torch.func.vmap(torch.func.grad(_chunk_loss, argnums=(0, 1), has_aux=True),
                                 in_dims=(0, 0, 0, 0, 0, None))
    try:
        (gw, gg), token_loss = per_memory(ws, gam, keys, values, lr, activation)
    except RuntimeError as e:
        if "saved tensor hooks" not in str(e):
            raise
        raise RuntimeError(
            'memgrad_hf Titans: grad_impl="autograd" (the torch.func.vmap(grad) reference) cannot run under saved '
            "tensor hooks, which non-reentrant gradient checkpointing installs (HF's default, and TRL's SFTTrainer "
            'turns checkpointing on by default). Use grad_impl="manual" (the same gradients, exact), or '
            "gradient_checkpointing_kwargs={'use_reentrant': True}, or turn checkpointing off.") from e
    retrieved = None if queries is None else memory_forward(weights, gamma, queries, activation)
    return list(gw), gg, retrieved, token_loss if return_loss else None
