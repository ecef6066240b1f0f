"""``NeuralMemory``: a Titans long-term memory layer whose inner gradient is an exact manual kernel.

Per head, a small MLP ``M`` (see :mod:`memgrad_hf.kernels.titans`) is trained during the forward pass on the
associative loss ``lr_t * mean_d (M(k_t) - v_t)^2``, chunk by chunk. For chunk ``n`` (``chunk_size`` tokens):

- the queries of chunk ``n`` are answered by ``M_{n-1}`` (the weights after chunks ``0..n-1``: causal);
- the gradient ``g_n`` is taken at ``M_{n-1}`` (Titans' parallel form within a chunk);
- momentum ``S_n = eta_n S_{n-1} - g_n`` and forgetting ``M_n = (1 - alpha_n) M_{n-1} + S_n``, with ``eta_n`` and
  ``alpha_n`` gated per chunk and head from the chunk's mean input.

Processing a sequence in segments of any length gives the same result as in one call: tokens that do not fill a
chunk wait in the state (:class:`NeuralMemState`) and join the next segment's first chunk. That is what makes
token-by-token cached generation equal the uncached forward.

A store mask (``forward(x, mask=...)``, 0 for padding) keeps tokens out of the memory: they get learning rate 0 and
no weight in their chunk's gate averages, and a chunk in which a sequence has no token leaves that sequence's
memory and momentum as they were. Nothing a masked token holds reaches any other token's output or the state.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memgrad_hf.kernels import titans as K
from memgrad_hf.kernels import titans_step_impl

logger = logging.getLogger(__name__)

GRAD_IMPLS = ("manual", "autograd", "fan")


@dataclass
class NeuralMemState:
    """What a memory carries from one segment to the next (per ``batch x heads`` memory).

    ``weights``/``gamma``: the memory after the last complete chunk; ``momentum``: the surprise ``S`` for each of
    them (``None`` when momentum is off); ``pending``: the per-token store inputs ``(keys, values, lr, eta_logit,
    alpha_logit)`` of the tokens that have not filled a chunk yet, plus their store mask once the sequence has used
    one (a masked sequence stays masked: later segments without a mask count as all ones); ``seq_index``: tokens
    seen so far.
    """

    weights: tuple[Tensor, ...]
    gamma: Tensor
    momentum: tuple[Tensor, ...] | None
    pending: tuple[Tensor, ...]
    seq_index: int = 0

    def detach(self) -> NeuralMemState:
        """The same state cut from the autograd graph (truncated backpropagation across segments)."""
        det = lambda ts: None if ts is None else tuple(t.detach() for t in ts)
        return replace(self, weights=det(self.weights), gamma=self.gamma.detach(), momentum=det(self.momentum),
                       pending=det(self.pending))


def _bcast(gate: Tensor, like: Tensor) -> Tensor:
    """A per-memory gate ``(G, 1, 1)`` shaped to broadcast against ``like`` (``(G, a, b)`` or ``(G, D)``)."""
    return gate if like.dim() == 3 else gate[..., 0]


def _update(params: tuple[Tensor, ...], mom: tuple[Tensor, ...] | None, grads: tuple[Tensor, ...],
            eta: Tensor | None, keep: Tensor | None, owned: bool,
            ) -> tuple[tuple[Tensor, ...], Tensor, tuple[Tensor, ...] | None]:
    """One chunk's momentum and forgetting: ``P = eta P + g`` (``P = -S``), ``W = keep W - P``.

    ``owned``: ``params``/``mom`` were made by an earlier chunk of this call. Then, when no graph is being recorded
    (inference), they are updated in place: the scan allocates nothing per step. Otherwise each step makes new
    tensors, which is what the backward needs (every ``W_n`` and ``P_n``) and never touches the caller's state.
    """
    gates = tuple(g for g in (eta, keep) if g is not None)
    inplace = owned and not (torch.is_grad_enabled() and any(t.requires_grad for t in (*params, *grads, *gates)))
    if mom is not None:
        if inplace:
            mom = tuple(torch.addcmul(g, _bcast(eta, g), p, out=p) for g, p in zip(grads, mom, strict=True))
        else:
            mom = tuple(torch.addcmul(g, _bcast(eta, g), p) for g, p in zip(grads, mom, strict=True))
        grads = mom
    if inplace:
        new = [(w.mul_(_bcast(keep, u)) if keep is not None else w).sub_(u) for w, u in zip(params, grads, strict=True)]
    elif keep is not None:
        new = [torch.sub(_bcast(keep, u) * w, u) for w, u in zip(params, grads, strict=True)]
    else:
        new = [w - u for w, u in zip(params, grads, strict=True)]
    return tuple(new[:-1]), new[-1], mom


class NeuralMemory(nn.Module):
    """Titans neural long-term memory.

    Args:
        dim: model width of the input and output.
        heads: independent memories per token; ``dim_head`` their width (default ``dim // heads``).
        depth: layers of the memory MLP (1-4); ``expansion``: hidden width factor; ``activation``: ``"gelu"``
            (exact erf) or ``"silu"``.
        chunk_size: tokens per memory update.
        momentum / forget: learned momentum ``eta`` and forgetting ``alpha`` gates (off: ``eta=0``, ``alpha=0``).
        grad_impl: ``"manual"`` (exact hand-written kernel), ``"autograd"`` (the ``torch.func.vmap(grad)``
            reference, for verification; fails under non-reentrant checkpointing, as titans-pytorch does) or
            ``"fan"`` (a learned :class:`memgrad_hf.titans.FAN` predicts the gradient; needs ``fan=True``).
        max_lr: the per-token learning rate is ``max_lr * sigmoid(w . x)``.
        fan: create a :class:`~memgrad_hf.titans.FAN` (trained by distillation against the exact gradient).

    ``forward(x, state=None, mask=None)`` takes ``x`` of shape ``(batch, tokens, dim)`` and returns
    ``(retrieved, state)``; ``state=None`` starts from the learned initial memory; ``mask`` ``(batch, tokens)``
    (1 = store, 0 = padding) keeps tokens out of the memory (see the module docstring). ``exact_grad_calls``
    counts exact inner-gradient kernel calls (chunks x calls).

    Example::

        mem = NeuralMemory(512, heads=8, chunk_size=64)
        y, state = mem(x[:, :1000])            # segments of any length
        y2, state = mem(x[:, 1000:], state)    # == the second part of mem(x)[0]
    """

    def __init__(
        self,
        dim: int,
        *,
        heads: int = 1,
        dim_head: int | None = None,
        depth: int = 2,
        expansion: int = 4,
        activation: str = "gelu",
        chunk_size: int = 64,
        momentum: bool = True,
        forget: bool = True,
        grad_impl: str = "manual",
        max_lr: float = 0.1,
        fan: bool = False,
    ) -> None:
        super().__init__()
        sizes = {"dim": dim, "heads": heads, "dim_head": dim_head, "depth": depth, "expansion": expansion,
                 "chunk_size": chunk_size}
        for name, value in sizes.items():  # (a float chunk_size failed only in forward; heads=0 divided by zero)
            if value is None and name == "dim_head":
                continue
            if not hasattr(value, "__index__") or isinstance(value, bool) or value < 1:
                raise ValueError(f"NeuralMemory: {name} must be a positive integer; got {value!r}.")
        if not isinstance(max_lr, (int, float)) or isinstance(max_lr, bool) or not math.isfinite(max_lr) or max_lr <= 0:
            raise ValueError(f"NeuralMemory: max_lr must be a finite number > 0 (the inner step's largest learning "
                             f"rate); got {max_lr!r}.")
        for name, flag in (("momentum", momentum), ("forget", forget), ("fan", fan)):
            if not isinstance(flag, bool):  # ("no" is truthy)
                raise ValueError(f"NeuralMemory: {name} must be True or False; got {flag!r}.")
        if dim_head is None:
            if dim % heads:
                raise ValueError(f"NeuralMemory: dim={dim} is not divisible by heads={heads}; pass dim_head.")
            dim_head = dim // heads
        if not 1 <= depth <= 4:
            raise ValueError(f"NeuralMemory: depth={depth}; the memory MLP supports depth 1 to 4.")
        if activation not in K.ACTIVATIONS:
            raise ValueError(f"NeuralMemory: activation={activation!r}; use one of {K.ACTIVATIONS}.")
        self.dim, self.heads, self.dim_head, self.depth = dim, heads, dim_head, depth
        self.activation, self.chunk_size, self.max_lr = activation, chunk_size, max_lr
        self.use_momentum, self.use_forget = momentum, forget
        inner = heads * dim_head
        self.store_norm = nn.RMSNorm(dim, eps=K.NORM_EPS)
        self.retrieve_norm = nn.RMSNorm(dim, eps=K.NORM_EPS)
        self.to_keys = nn.Linear(dim, inner, bias=False)
        self.to_values = nn.Linear(dim, inner, bias=False)
        self.to_queries = nn.Linear(dim, inner, bias=False)
        # lr, momentum and forget logits per head in one projection (3 x heads outputs).
        self.to_gates = nn.Linear(dim, 3 * heads)
        self.to_out = nn.Linear(inner, dim, bias=False)
        widths = [dim_head] + [dim_head * expansion] * (depth - 1) + [dim_head]
        self.memory_weights = nn.ParameterList(
            nn.Parameter(nn.init.xavier_uniform_(torch.empty(widths[i], widths[i + 1]))) for i in range(depth)
        )
        self.memory_gamma = nn.Parameter(torch.zeros(dim_head))
        self.fan = None
        if fan:
            from memgrad_hf.titans.fan import FAN

            self.fan = FAN(dim_head, widths[1:])
        self.exact_grad_calls = 0
        self._idle_fan_warned = False  # (a FAN neither distilled nor used: said once per memory)
        self.grad_impl = grad_impl  # validated by the setter

    @property
    def grad_impl(self) -> str:
        return self._grad_impl

    @grad_impl.setter
    def grad_impl(self, value: str) -> None:
        if value not in GRAD_IMPLS:
            raise ValueError(f"NeuralMemory: grad_impl={value!r}; use one of {GRAD_IMPLS}.")
        if value == "fan" and self.fan is None:
            raise ValueError("NeuralMemory: grad_impl='fan' needs a FAN; construct with fan=True.")
        self._grad_impl = value

    # -- state ----------------------------------------------------------------------------------------------------
    def initial_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None,
                      ) -> NeuralMemState:
        """The learned initial memory for ``batch`` sequences (shared weights, not copied per sequence)."""
        g, dh = batch * self.heads, self.dim_head
        ref = self.memory_gamma
        device, dtype = device or ref.device, dtype or ref.dtype
        empty = lambda *s: torch.zeros(g, 0, *s, device=device, dtype=dtype)
        pending = (empty(dh), empty(dh), empty(), empty(), empty())
        mom = None
        if self.use_momentum:
            mom = tuple(torch.zeros((), device=device, dtype=dtype) for _ in self.memory_weights)
            mom = (*mom, torch.zeros((), device=device, dtype=dtype))
        return NeuralMemState(tuple(self.memory_weights), self.memory_gamma, mom, pending, 0)

    # -- forward --------------------------------------------------------------------------------------------------
    def _split_heads(self, t: Tensor) -> Tensor:  # (B, T, h*dh) -> (B*h, T, dh)
        b, n, _ = t.shape
        return t.view(b, n, self.heads, -1).transpose(1, 2).reshape(b * self.heads, n, -1)

    def _store_inputs(self, x: Tensor) -> tuple[Tensor, ...]:
        xs = K.rms_norm(x, self.store_norm.weight, self.store_norm.eps)
        k = K.rms_norm(self._split_heads(self.to_keys(xs)))
        v = self._split_heads(self.to_values(xs))
        gates = self._split_heads(self.to_gates(xs))  # (G, T, 3)
        lr = torch.sigmoid(gates[..., 0]) * self.max_lr
        return k, v, lr, gates[..., 1], gates[..., 2]

    def _inner_step(self, weights, gamma, k, v, lr, q):
        if self._grad_impl == "fan":
            return self.fan.memory_step(weights, gamma, k, v, lr, q, self.activation)
        self.exact_grad_calls += 1
        step = titans_step_impl(k.device) if self._grad_impl == "manual" else K.memory_step_autograd
        grads, dgamma, retrieved, _ = step(list(weights), gamma, k, v, lr, q, self.activation, return_loss=False)
        if self.fan is not None and self.training and torch.is_grad_enabled():
            if self.fan.distilling:
                # the FAN learns from this exact gradient; its loss rides on the retrieval's backward
                retrieved = self.fan.observe(weights, gamma, k, v, lr, grads, self.activation, attach_to=retrieved)
            elif (not self._idle_fan_warned and not self.fan.frozen
                  and any(p.requires_grad for p in self.fan.parameters())):
                self._idle_fan_warned = True
                logger.warning(
                    "NeuralMemory(fan=True) trains with the exact gradient while its FAN is neither distilled nor "
                    "used: the FAN's parameters are trainable but get no gradient (DDP: unused parameters). Pass "
                    "memgrad_hf.callbacks.FANDistillationCallback(distill_steps=N) to the Trainer (or set "
                    "mem.fan.distilling = True in your own loop), or build the memory without fan=True.")
        return grads, dgamma, retrieved

    def forward(self, x: Tensor, state: NeuralMemState | None = None, mask: Tensor | None = None,
                ) -> tuple[Tensor, NeuralMemState]:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"NeuralMemory: expected x of shape (batch, tokens, {self.dim}); got {tuple(x.shape)}.")
        b, t, _ = x.shape
        if self.fan is not None and self.fan.distilling and self.training:
            self.fan.check_autocast(x.device.type)
        if mask is not None and tuple(mask.shape) != (b, t):
            raise ValueError(f"NeuralMemory: mask must have shape (batch, tokens) = {(b, t)}; got {tuple(mask.shape)}.")
        if state is None:
            state = self.initial_state(b, x.device, x.dtype)
        elif state.pending[0].shape[0] != b * self.heads:
            raise ValueError(
                f"NeuralMemory: the state holds {state.pending[0].shape[0] // self.heads} sequences but x has batch "
                f"{b}; "
                "pass the state returned for this batch (or state=None to start new sequences)."
            )
        if t == 0:  # an empty segment: nothing to store or retrieve
            return self.to_out(x.new_zeros(b, 0, self.heads * self.dim_head)), state
        # The norms through K.rms_norm (same math as nn.RMSNorm / F.rms_norm; fewer passes and saved bytes on CPU).
        q = K.rms_norm(self._split_heads(self.to_queries(K.rms_norm(x, self.retrieve_norm.weight,
                                                                     self.retrieve_norm.eps))))
        new = self._store_inputs(x)
        if mask is not None or len(state.pending) == 6:  # masked: the mask rides along as a sixth store input
            m = x.new_ones(b * self.heads, t) if mask is None else mask.to(x.dtype).repeat_interleave(self.heads, 0)
            k, v, lr, eta_logit, alpha_logit = new
            new = (k, v, lr * m, eta_logit, alpha_logit, m)
        if torch.is_autocast_enabled(x.device.type):
            # The projections ran in the autocast dtype; the memory's own gradient descent (a recurrence over chunks)
            # runs in its parameters' dtype, as autocast keeps norms and reductions in fp32.
            dtype = self.memory_gamma.dtype
            q, new = q.to(dtype), tuple(z.to(dtype) for z in new)
            with torch.autocast(x.device.type, enabled=False):
                y, new_state = self._scan(q, new, state, b, t)
        else:
            y, new_state = self._scan(q, new, state, b, t)
        return self.to_out(y), new_state

    def _scan(self, q: Tensor, new: tuple[Tensor, ...], state: NeuralMemState, b: int, t: int,
              ) -> tuple[Tensor, NeuralMemState]:
        """Store and retrieve chunk by chunk; returns the retrieval ``(b, t, heads * dim_head)`` and the state."""
        r, c = state.pending[0].shape[1], self.chunk_size
        pend = state.pending
        masked = len(new) == 6
        if masked and len(pend) == 5:  # the first masked segment of a sequence: its pending tokens were all stored
            pend = (*pend, pend[2].new_ones(pend[2].shape))
        if r:  # prepend the tokens still waiting for a full chunk (a copy of each store input: only when needed)
            new = tuple(torch.cat([p, n], dim=1) for p, n in zip(pend, new, strict=True))
            # Queries aligned with the combined (pending + new) stream; the r pending tokens were answered before.
            q = F.pad(q, (0, 0, r, 0))
        k, v, lr, eta_logit, alpha_logit = new[:5]
        n_full = (r + t) // c
        full = n_full * c
        # Chunk views from one split per tensor: its backward is one concatenation, where per-chunk slices would each
        # zero-fill a gradient buffer of the whole sequence (quadratic in the number of chunks).
        ks, vs, lrs, qs = (z.split(c, dim=1) for z in (k, v, lr, q))
        chunk_mean = lambda z: z[:, :full].unflatten(1, (n_full, c)).mean(2)
        empty = None  # masked: (G, n_full) bool, the chunks in which a memory stores nothing
        if masked and n_full:
            m = new[5][:, :full].unflatten(1, (n_full, c))
            count = m.sum(2)
            empty = count == 0
            chunk_mean = lambda z: (z[:, :full].unflatten(1, (n_full, c)) * m).sum(2) / count.clamp_min(1)
        # Momentum and forgetting gates of every chunk and head at once, as (G, 1, ..) broadcast views per chunk.
        etas = keeps = None
        if self.use_momentum and n_full:
            etas = torch.sigmoid(chunk_mean(eta_logit))[..., None, None].unbind(1)
        if self.use_forget and n_full:
            keeps = (1 - torch.sigmoid(chunk_mean(alpha_logit)))[..., None, None].unbind(1)
        weights, gamma = state.weights, state.gamma
        # The recurrence runs on P = -S (momentum of the gradient rather than of the surprise): P_n = eta P + g is one
        # fused op per tensor, and W_n = keep W - P one more; the state carries S, negated back at the end.
        mom = None if state.momentum is None else tuple(-m for m in state.momentum)
        outs = []
        for n in range(n_full):
            grads, dgamma, retrieved = self._inner_step(weights, gamma, ks[n], vs[n], lrs[n], qs[n])
            outs.append(retrieved)
            eta = None if mom is None else etas[n]
            keep = None if keeps is None else keeps[n]
            if empty is None:
                weights, gamma, mom = _update((*weights, gamma), mom, (*grads, dgamma), eta, keep, owned=n > 0)
                continue
            old = (*weights, gamma), mom
            weights, gamma, mom = _update((*weights, gamma), mom, (*grads, dgamma), eta, keep, owned=False)
            skip = empty[:, n, None, None]  # (G, 1, 1): nothing stored here, so this memory stays as it was
            weights, gamma = (tuple(torch.where(_bcast(skip, w), w0, w) for w0, w in zip(old[0][:-1], weights,
                                                                                        strict=True)),
                              torch.where(_bcast(skip, gamma), old[0][-1], gamma))
            if mom is not None:
                mom = tuple(torch.where(_bcast(skip, p), p0, p) for p0, p in zip(old[1], mom, strict=True))
        if r + t > full:
            outs.append(K.memory_forward(list(weights), gamma, qs[n_full], self.activation))
        if outs:
            # One copy straight into (batch, tokens, heads, dim_head) order, not a concatenation plus a transpose.
            y = torch.cat([o.unflatten(0, (b, self.heads)).transpose(1, 2) for o in outs], dim=1)[:, r:]
            y = y.reshape(b, t, -1)
        else:
            y = q.new_zeros(b, t, self.heads * self.dim_head)
        pending = tuple(p[:, full:] for p in new)
        mom = None if mom is None else tuple(-p for p in mom)
        return y, NeuralMemState(weights, gamma, mom, pending, state.seq_index + t)
