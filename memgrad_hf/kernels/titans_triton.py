"""Triton twin of :func:`memgrad_hf.kernels.titans.memory_step`: one chunk of the Titans memory in one kernel launch.

Why a fused kernel: the torch twin runs the memory MLP, LayerNorm, loss and the 3L-1 gradient GEMMs as ~20 separate
ops, each a launch that round-trips its ``(G, C, H)`` intermediate through memory. Here one program per memory
(``G = batch x heads`` programs for the chunk) does the whole step: the MLP forward on the queries (retrieval) and on
the keys, the LayerNorm (no affine, eps 1e-5), the residual ``Y = LN(M)*(gamma+1) + x``, the loss gradient
``dY = (2/D) lr (Y - V)``, ``dgamma``, the LayerNorm backward and every ``dW_i = A_i^T G_i`` with the chain through
the activation derivative (erf GELU: ``Phi(z) + z phi(z)``; SiLU: ``s (1 + z (1 - s))``). LayerNorm, loss and the
activations are fused into the GEMM prologues/epilogues, so only the pre-activations ``Z_i`` of the hidden layers
and ``dM`` go through a small per-program fp32 scratch (L2-resident on a GPU); in the backward each ``G_{i-1}`` is
written in place over ``Z_{i-1}``, so the scratch is ``(L-1)`` hidden-width rows plus one ``D`` row per token.

Tiling: the chunk rows go in blocks of ``BC`` tokens, the hidden widths in ``BK``/``BN`` tiles, and a LayerNorm row
(the head width ``D``) in one ``BD = next_pow2(D)`` tile; all dots are IEEE fp32 (``input_precision="ieee"``) so the
result matches the torch twin to ~1e-6 relative. Any sizes work (non-powers-of-two are masked); ``D`` is limited to
256 (one register tile per LayerNorm row). Depth 1-4, ``"gelu"`` or ``"silu"``, shared 2-D weights (stride 0 over
the memories) or per-memory 3-D weights, with or without queries.

Autograd: Triton forward, torch-twin backward. Under ``torch.no_grad()`` (or when no input requires grad) only the
kernel runs. Otherwise the kernel runs inside a :class:`torch.autograd.Function` whose backward recomputes the step
with the differentiable torch twin and returns ``torch.autograd.grad`` of it, so the outer gradients (second-order
terms of the inner loss) are exact and the twin is a drop-in for training; with ``create_graph=True`` the recompute
keeps its graph to the original inputs, so double backward is exact too.

On CPU the kernel runs only under ``TRITON_INTERPRET=1`` (slowly; used by the tests). On a GPU it is selected by
:func:`memgrad_hf.kernels.titans_step_impl` when ``MEMGRAD_BACKEND=triton`` (slower than the torch kernel on an H100
in training and at D >= 128, see benchmarks/RESULTS.md), and by the torch kernel's ``memory_step`` for an inference
step at head width <= 64 and MLP width <= 256, where it is the faster one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from memgrad_hf.kernels import titans as _torch_twin

LN_EPS = _torch_twin.LN_EPS
ACTIVATIONS = _torch_twin.ACTIVATIONS
MAX_DEPTH = 4
MAX_HEAD_DIM = 256
_ACT_CODE = {"gelu": 1, "silu": 2}


@triton.jit
def _act_fwd(z, ACT: tl.constexpr):
    """``act(z)`` for ACT 1 (erf GELU) or 2 (SiLU); ACT 0 is the identity (the keys, before layer 0)."""
    if ACT == 1:
        out = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACT == 2:
        out = z * tl.sigmoid(z)
    else:
        out = z
    return out


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    """``act'(z)``: erf GELU ``Phi(z) + z phi(z)`` (as aten's gelu_backward), SiLU ``s (1 + z (1 - s))``."""
    if ACT == 1:
        d = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    else:
        s = tl.sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    return d


@triton.jit
def _linear_tile(a_ptr, s_ar, w_ptr, s_wk, s_wn, r0, R, K, n0, N, ACT_IN: tl.constexpr,
                 BC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """``act(A[r0:r0+BC, :]) @ W[:, n0:n0+BN]`` as an fp32 register tile; masked rows/columns come out 0."""
    rows = r0 + tl.arange(0, BC)
    cols = n0 + tl.arange(0, BN)
    rmask = rows < R
    cmask = cols < N
    acc = tl.zeros((BC, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        a = tl.load(a_ptr + rows[:, None] * s_ar + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        a = _act_fwd(a, ACT_IN)  # act(0) = 0: the masked entries stay out of the sum
        w = tl.load(w_ptr + ks[:, None] * s_wk + cols[None, :] * s_wn, mask=kmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    return acc


@triton.jit
def _linear_to_scratch(a_ptr, s_ar, w_ptr, s_wk, s_wn, z_ptr, r0, R, K, N, ACT_IN: tl.constexpr,
                       BC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """A hidden layer for one row block: ``Z[r0:r0+BC, :] = act(A) @ W`` into the scratch (row stride ``N``)."""
    rows = r0 + tl.arange(0, BC)
    rmask = rows < R
    for n0 in range(0, N, BN):
        acc = _linear_tile(a_ptr, s_ar, w_ptr, s_wk, s_wn, r0, R, K, n0, N, ACT_IN, BC, BK, BN)
        cols = n0 + tl.arange(0, BN)
        tl.store(z_ptr + rows[:, None] * N + cols[None, :], acc, mask=rmask[:, None] & (cols < N)[None, :])


@triton.jit
def _mlp_rows(x_ptr, s_xr, r0, R,
              w0, s0k, s0n, w1, s1k, s1n, w2, s2k, s2n, w3, s3k, s3n,
              z0, z1, z2, D, H1, H2, H3,
              DEPTH: tl.constexpr, ACT: tl.constexpr,
              BC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """``MLP(x)`` for rows ``r0:r0+BC`` as a ``[BC, BD]`` tile; the hidden pre-activations land in the scratch."""
    tl.debug_barrier()  # the previous row block / segment may still be reading the scratch rows this one rewrites
    if DEPTH == 1:
        m = _linear_tile(x_ptr, s_xr, w0, s0k, s0n, r0, R, D, 0, D, 0, BC, BK, BD)
    else:
        _linear_to_scratch(x_ptr, s_xr, w0, s0k, s0n, z0, r0, R, D, H1, 0, BC, BK, BN)
        tl.debug_barrier()
        if DEPTH == 2:
            m = _linear_tile(z0, H1, w1, s1k, s1n, r0, R, H1, 0, D, ACT, BC, BK, BD)
        else:
            _linear_to_scratch(z0, H1, w1, s1k, s1n, z1, r0, R, H1, H2, ACT, BC, BK, BN)
            tl.debug_barrier()
            if DEPTH == 3:
                m = _linear_tile(z1, H2, w2, s2k, s2n, r0, R, H2, 0, D, ACT, BC, BK, BD)
            else:
                _linear_to_scratch(z1, H2, w2, s2k, s2n, z2, r0, R, H2, H3, ACT, BC, BK, BN)
                tl.debug_barrier()
                m = _linear_tile(z2, H3, w3, s3k, s3n, r0, R, H3, 0, D, ACT, BC, BK, BD)
    return m


@triton.jit
def _layer_norm_residual(m, x_ptr, s_xr, g1, r0, R, D, eps, BC: tl.constexpr, BD: tl.constexpr):
    """``Y = LN(M) * (gamma + 1) + x`` for one row block; returns ``(Y, LN(M), rstd, rows, row mask, mask)``."""
    rows = r0 + tl.arange(0, BC)
    cols = tl.arange(0, BD)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    mean = tl.sum(m, axis=1) / D
    xc = tl.where(cmask[None, :], m - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / D
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))  # IEEE sqrt/div, as aten's layer norm
    h = xc * rstd[:, None]
    x = tl.load(x_ptr + rows[:, None] * s_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = h * g1[None, :] + x
    return y, h, rstd, rows, rmask, mask


@triton.jit
def _layer_backward(a_ptr, s_ar, ACT_A: tl.constexpr, g_ptr, s_gr, w_ptr, s_wk, s_wn, dw_ptr, C, K, N,
                    HAS_PREV: tl.constexpr, ACT: tl.constexpr,
                    BC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """Layer ``i`` of the backward: ``dW_i = act(A)^T G_i`` over the chunk and, for ``i > 0``,
    ``G_{i-1} = (G_i W_i^T) * act'(Z_{i-1})`` written in place over ``Z_{i-1}`` (which is ``a_ptr``)."""
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        for n0 in range(0, N, BN):
            ns = n0 + tl.arange(0, BN)
            nmask = ns < N
            acc = tl.zeros((BK, BN), dtype=tl.float32)
            for r0 in range(0, C, BC):
                rows = r0 + tl.arange(0, BC)
                rmask = rows < C
                at = tl.load(a_ptr + rows[None, :] * s_ar + ks[:, None], mask=kmask[:, None] & rmask[None, :],
                             other=0.0).to(tl.float32)
                at = _act_fwd(at, ACT_A)
                g = tl.load(g_ptr + rows[:, None] * s_gr + ns[None, :], mask=rmask[:, None] & nmask[None, :],
                            other=0.0)
                acc = tl.dot(at, g, acc, input_precision="ieee")
            tl.store(dw_ptr + ks[:, None] * N + ns[None, :], acc.to(dw_ptr.dtype.element_ty),
                     mask=kmask[:, None] & nmask[None, :])
    if HAS_PREV:
        tl.debug_barrier()  # dW_i has read Z_{i-1}; now it is overwritten with G_{i-1}
        for r0 in range(0, C, BC):
            rows = r0 + tl.arange(0, BC)
            rmask = rows < C
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < K
                acc = tl.zeros((BC, BK), dtype=tl.float32)
                for n0 in range(0, N, BN):
                    ns = n0 + tl.arange(0, BN)
                    nmask = ns < N
                    g = tl.load(g_ptr + rows[:, None] * s_gr + ns[None, :], mask=rmask[:, None] & nmask[None, :],
                                other=0.0)
                    wt = tl.load(w_ptr + ks[None, :] * s_wk + ns[:, None] * s_wn, mask=nmask[:, None] & kmask[None, :],
                                 other=0.0).to(tl.float32)
                    acc = tl.dot(g, wt, acc, input_precision="ieee")
                # the same pointer tensor loads and stores: each thread rewrites only the elements it read
                z_ptrs = a_ptr + rows[:, None] * s_ar + ks[None, :]
                zmask = rmask[:, None] & kmask[None, :]
                z = tl.load(z_ptrs, mask=zmask, other=0.0)
                tl.store(z_ptrs, acc * _act_grad(z, ACT), mask=zmask)
        tl.debug_barrier()


@triton.jit
def _titans_step_kernel(
    k_ptr, s_kg, s_kr, v_ptr, s_vg, s_vr, lr_ptr, s_lg, s_lr, gam_ptr, s_gamg, q_ptr, s_qg, s_qr,
    w0, s0g, s0k, s0n, w1, s1g, s1k, s1n, w2, s2g, s2k, s2n, w3, s3g, s3k, s3n,
    dw0, s_dw0, dw1, s_dw1, dw2, s_dw2, dw3, s_dw3,
    z0, s_z0, z1, s_z1, z2, s_z2, dm_ptr, dgam_ptr, ret_ptr, tl_ptr,
    C, CQ, D, H1, H2, H3, eps,
    DEPTH: tl.constexpr, ACT: tl.constexpr, HAS_Q: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    # this memory's slices: weights (stride 0 over g when shared), scratch, outputs
    w0 += g * s0g
    w1 += g * s1g
    w2 += g * s2g
    w3 += g * s3g
    dw0 += g * s_dw0
    dw1 += g * s_dw1
    dw2 += g * s_dw2
    dw3 += g * s_dw3
    z0 += g * s_z0
    z1 += g * s_z1
    z2 += g * s_z2
    dm_ptr += g * C * D
    k_ptr += g * s_kg
    v_ptr += g * s_vg
    lr_ptr += g * s_lg
    cols = tl.arange(0, BD)
    cmask = cols < D
    g1 = tl.load(gam_ptr + g * s_gamg + cols, mask=cmask, other=0.0).to(tl.float32) + 1.0

    # retrieval first: the keys' forward below must leave its pre-activations in the scratch for the backward
    if HAS_Q:
        q_ptr += g * s_qg
        ret_ptr += g * CQ * D
        for r0 in range(0, CQ, BC):
            m = _mlp_rows(q_ptr, s_qr, r0, CQ, w0, s0k, s0n, w1, s1k, s1n, w2, s2k, s2n, w3, s3k, s3n,
                          z0, z1, z2, D, H1, H2, H3, DEPTH, ACT, BC, BK, BN, BD)
            y, h, rstd, rows, rmask, mask = _layer_norm_residual(m, q_ptr, s_qr, g1, r0, CQ, D, eps, BC, BD)
            tl.store(ret_ptr + rows[:, None] * D + cols[None, :], y.to(ret_ptr.dtype.element_ty), mask=mask)

    # store: forward on the keys, loss, dgamma and the LayerNorm backward, row block by row block
    dgam = tl.zeros((BD,), dtype=tl.float32)
    for r0 in range(0, C, BC):
        m = _mlp_rows(k_ptr, s_kr, r0, C, w0, s0k, s0n, w1, s1k, s1n, w2, s2k, s2n, w3, s3k, s3n,
                      z0, z1, z2, D, H1, H2, H3, DEPTH, ACT, BC, BK, BN, BD)
        y, h, rstd, rows, rmask, mask = _layer_norm_residual(m, k_ptr, s_kr, g1, r0, C, D, eps, BC, BD)
        v = tl.load(v_ptr + rows[:, None] * s_vr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        lr = tl.load(lr_ptr + rows * s_lr, mask=rmask, other=0.0).to(tl.float32)
        diff = tl.where(mask, y - v, 0.0)
        tl.store(tl_ptr + g * C + rows, (tl.sum(diff * diff, axis=1) / D).to(tl_ptr.dtype.element_ty), mask=rmask)
        dy = diff * (lr * (2.0 / D))[:, None]
        dgam += tl.sum(dy * h, axis=0)
        dh = dy * g1[None, :]
        mean_dh = tl.sum(dh, axis=1) / D
        mean_dhh = tl.sum(dh * h, axis=1) / D
        dm = rstd[:, None] * (dh - mean_dh[:, None] - h * mean_dhh[:, None])
        tl.store(dm_ptr + rows[:, None] * D + cols[None, :], dm, mask=mask)
    tl.store(dgam_ptr + g * D + cols, dgam.to(dgam_ptr.dtype.element_ty), mask=cmask)
    tl.debug_barrier()

    # backward through the MLP, last layer first: G_{L-1} = dM; G_i (i < L-1) overwrites Z_i in the scratch
    if DEPTH == 1:
        _layer_backward(k_ptr, s_kr, 0, dm_ptr, D, w0, s0k, s0n, dw0, C, D, D, False, ACT, BC, BK, BN)
    elif DEPTH == 2:
        _layer_backward(z0, H1, ACT, dm_ptr, D, w1, s1k, s1n, dw1, C, H1, D, True, ACT, BC, BK, BN)
        _layer_backward(k_ptr, s_kr, 0, z0, H1, w0, s0k, s0n, dw0, C, D, H1, False, ACT, BC, BK, BN)
    elif DEPTH == 3:
        _layer_backward(z1, H2, ACT, dm_ptr, D, w2, s2k, s2n, dw2, C, H2, D, True, ACT, BC, BK, BN)
        _layer_backward(z0, H1, ACT, z1, H2, w1, s1k, s1n, dw1, C, H1, H2, True, ACT, BC, BK, BN)
        _layer_backward(k_ptr, s_kr, 0, z0, H1, w0, s0k, s0n, dw0, C, D, H1, False, ACT, BC, BK, BN)
    else:
        _layer_backward(z2, H3, ACT, dm_ptr, D, w3, s3k, s3n, dw3, C, H3, D, True, ACT, BC, BK, BN)
        _layer_backward(z1, H2, ACT, z2, H3, w2, s2k, s2n, dw2, C, H2, H3, True, ACT, BC, BK, BN)
        _layer_backward(z0, H1, ACT, z1, H2, w1, s1k, s1n, dw1, C, H1, H2, True, ACT, BC, BK, BN)
        _layer_backward(k_ptr, s_kr, 0, z0, H1, w0, s0k, s0n, dw0, C, D, H1, False, ACT, BC, BK, BN)


def _check_inputs(weights: list[Tensor], gamma: Tensor, keys: Tensor, values: Tensor, lr: Tensor,
                  queries: Tensor | None, activation: str) -> None:
    """Clear errors for what the kernel cannot take (the torch twin would fail later, or less clearly)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"titans_triton.memory_step: activation must be one of {ACTIVATIONS}; got {activation!r}.")
    if not 1 <= len(weights) <= MAX_DEPTH:
        raise ValueError(f"titans_triton.memory_step: depth must be 1..{MAX_DEPTH}; got {len(weights)} weights.")
    if keys.dim() != 3:
        raise ValueError(f"titans_triton.memory_step: keys must be (G, C, D); got {tuple(keys.shape)}.")
    G, C, D = keys.shape
    if D > MAX_HEAD_DIM:
        raise ValueError(f"titans_triton.memory_step: head width D={D} > {MAX_HEAD_DIM} (a LayerNorm row must fit "
                         "in one register tile); use the torch twin (MEMGRAD_BACKEND=torch).")
    if values.shape != keys.shape or lr.shape != (G, C):
        raise ValueError(f"titans_triton.memory_step: values must be {tuple(keys.shape)} and lr {(G, C)}; got "
                         f"{tuple(values.shape)} and {tuple(lr.shape)}.")
    if queries is not None and (queries.dim() != 3 or queries.shape[0] != G or queries.shape[2] != D):
        raise ValueError(f"titans_triton.memory_step: queries must be ({G}, Cq, {D}); got {tuple(queries.shape)}.")
    if gamma.shape not in ((D,), (G, D)):
        raise ValueError(f"titans_triton.memory_step: gamma must be ({D},) or ({G}, {D}); got {tuple(gamma.shape)}.")
    width = D
    for i, w in enumerate(weights):
        if w.dim() not in (2, 3) or (w.dim() == 3 and w.shape[0] != G) or w.shape[-2] != width:
            raise ValueError(f"titans_triton.memory_step: weight {i} must be ({width}, d_out) or ({G}, {width}, "
                             f"d_out); got {tuple(w.shape)}.")
        width = w.shape[-1]
    if width != D:
        raise ValueError(f"titans_triton.memory_step: the last weight must map back to D={D}; it has {width} outputs.")
    tensors = [*weights, gamma, keys, values, lr] + ([] if queries is None else [queries])
    if any(t.device != keys.device for t in tensors) or any(not t.is_floating_point() for t in tensors):
        raise ValueError("titans_triton.memory_step: all inputs must be floating-point tensors on one device.")


def _row_major(t: Tensor) -> Tensor:
    """The kernel takes any strides except along the last dimension (unit stride there keeps loads coalesced)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(weights: list[Tensor], gamma: Tensor, keys: Tensor, values: Tensor, lr: Tensor,
            queries: Tensor | None, activation: str) -> tuple[list[Tensor], Tensor, Tensor | None, Tensor]:
    """Run the kernel (no autograd): allocate outputs and scratch, pick tiles, launch ``G`` programs."""
    G, C, D = keys.shape
    depth = len(weights)
    dtype = keys.dtype
    keys, values = _row_major(keys), _row_major(values)
    queries = None if queries is None else _row_major(queries)
    gamma = gamma if gamma.stride(-1) == 1 else gamma.contiguous()
    lr = lr if lr.stride(-1) == 1 else lr.contiguous()
    hidden = [w.shape[-1] for w in weights[:-1]]
    hid = (hidden + [1, 1, 1])[:3]  # widths of the unused hidden layers: placeholders, never read
    cq = 0 if queries is None else queries.shape[1]
    rs = max(C, cq)  # scratch rows: the retrieval forward reuses the keys' scratch before the keys' forward
    dev = keys.device
    grads = [torch.empty(G, w.shape[-2], w.shape[-1], dtype=dtype, device=dev) for w in weights]
    dgamma = torch.empty(G, D, dtype=dtype, device=dev)
    token_loss = torch.empty(G, C, dtype=dtype, device=dev)
    retrieved = None if queries is None else torch.empty(G, cq, D, dtype=dtype, device=dev)
    scratch = [torch.empty(G, rs, h, dtype=torch.float32, device=dev) for h in hidden]
    dm = torch.empty(G, C, D, dtype=torch.float32, device=dev)

    def wargs(i: int) -> tuple:
        if i >= depth:
            return (keys, 0, 0, 0)  # placeholder pointer for an absent layer
        w = weights[i]
        return (w, w.stride(0) if w.dim() == 3 else 0, w.stride(-2), w.stride(-1))

    dws = [a for t in grads for a in (t, t.stride(0))] + [keys, 0] * (MAX_DEPTH - depth)  # placeholders: unread
    zs = [a for t in scratch for a in (t, t.stride(0))] + [dm, 0] * (MAX_DEPTH - depth)
    q = keys if queries is None else queries
    bd = max(16, triton.next_power_of_2(D))
    bc = 16 if C <= 16 else 32
    bk = 16 if min([D, *hidden]) <= 16 else 32
    bn = 16 if max([D, *hidden]) <= 16 else (32 if max([D, *hidden]) <= 32 else 64)
    _titans_step_kernel[(G,)](
        keys, keys.stride(0), keys.stride(1), values, values.stride(0), values.stride(1),
        lr, lr.stride(0), lr.stride(1), gamma, gamma.stride(0) if gamma.dim() == 2 else 0,
        q, q.stride(0), q.stride(1),
        *wargs(0), *wargs(1), *wargs(2), *wargs(3),
        *dws, *zs, dm, dgamma, retrieved if retrieved is not None else dgamma, token_loss,
        C, cq, D, *hid, LN_EPS,
        DEPTH=depth, ACT=_ACT_CODE[activation], HAS_Q=queries is not None,
        BC=bc, BK=bk, BN=bn, BD=bd, num_warps=4 if bd <= 64 else 8,  # [BC, BD] epilogue tiles
    )
    return grads, dgamma, retrieved, token_loss


class _MemoryStepFunction(torch.autograd.Function):
    """Triton forward, torch-twin backward: the backward recomputes :func:`memgrad_hf.kernels.titans.memory_step`
    under ``enable_grad`` and returns ``autograd.grad`` of it (exact; the step is cheap next to the outer model)."""

    @staticmethod
    def forward(ctx, activation: str, depth: int, has_q: bool, *tensors: Tensor):  # type: ignore[override]
        weights = list(tensors[:depth])
        gamma, keys, values, lr = tensors[depth:depth + 4]
        queries = tensors[depth + 4] if has_q else None
        grads, dgamma, retrieved, token_loss = _launch(weights, gamma, keys, values, lr, queries, activation)
        ctx.save_for_backward(*tensors)
        ctx.activation, ctx.depth, ctx.has_q = activation, depth, has_q
        ctx.set_materialize_grads(False)
        return (*grads, dgamma, token_loss) + ((retrieved,) if has_q else ())

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor | None):  # type: ignore[override]
        tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        create = torch.is_grad_enabled()  # double backward: keep the recompute attached to the original inputs
        with torch.enable_grad():
            ins = [t if create else t.detach().requires_grad_(n) for t, n in zip(tensors, needs, strict=True)]
            d = ctx.depth
            grads, dgamma, retrieved, token_loss = _torch_twin.memory_step(
                ins[:d], ins[d], ins[d + 1], ins[d + 2], ins[d + 3], ins[d + 4] if ctx.has_q else None,
                ctx.activation)
            outs = (*grads, dgamma, token_loss) + ((retrieved,) if ctx.has_q else ())
            pairs = [(o, g) for o, g in zip(outs, grad_outputs, strict=True) if g is not None and o.requires_grad]
            wanted = [i for i, n in enumerate(needs) if n]
            result: list[Tensor | None] = [None] * len(tensors)
            if pairs and wanted:
                got = torch.autograd.grad([o for o, _ in pairs], [ins[i] for i in wanted], [g for _, g in pairs],
                                          allow_unused=True, create_graph=create)
                for i, gi in zip(wanted, got, strict=True):
                    result[i] = gi
        return (None, None, None, *result)


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
    """Same contract as :func:`memgrad_hf.kernels.titans.memory_step`, computed by one Triton kernel.

    Returns ``(weight_grads, gamma_grad, retrieved, token_loss)``: ``(G, d_in, d_out)`` per layer, ``(G, D)``,
    ``(G, Cq, D)`` or ``None``, ``(G, C)`` (``None`` unless ``return_loss``; the kernel computes it in passing).
    Differentiable (Triton forward, torch-twin backward).

    Raises:
        ValueError: depth outside 1..4, an unknown activation, ``D > 256``, or inconsistent shapes.

    Example::

        grads, dgamma, retrieved, _ = memory_step([w0, w1], gamma, k, v, lr, queries=q)
    """
    weights = list(weights)
    _check_inputs(weights, gamma, keys, values, lr, queries, activation)
    if keys.numel() == 0 or (queries is not None and queries.shape[1] == 0):  # no programs to launch
        return _torch_twin.memory_step(weights, gamma, keys, values, lr, queries, activation, return_loss=return_loss)
    tensors = [*weights, gamma, keys, values, lr] + ([] if queries is None else [queries])
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        grads, dgamma, retrieved, token_loss = _launch(weights, gamma, keys, values, lr, queries, activation)
        return grads, dgamma, retrieved, token_loss if return_loss else None
    depth = len(weights)
    outs = _MemoryStepFunction.apply(activation, depth, queries is not None, *tensors)
    retrieved = outs[depth + 2] if queries is not None else None
    return list(outs[:depth]), outs[depth], retrieved, outs[depth + 1] if return_loss else None
