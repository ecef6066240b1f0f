"""A stand-in for the logits that records what a model's forward does to them.

While a patched model runs a training forward, its output-embedding module returns a :class:`LogitsProbe`
instead of computing ``[tokens x vocab]`` logits. The probe holds no data; every op the model applies to it
(softcapping, logit scales, a vocab slice, a dtype cast) is parsed into an :class:`~memgrad_hf.kernels.head.
Epilogue` that the chunked head then applies per chunk. Ops that only pick or arrange token positions (a slice or
select on a token axis, a boolean or integer index of the positions, a reshape that keeps the vocab axis: e.g.
``logits[..., :-1, :][attention_mask != 0]`` before the model's own cross-entropy) are replayed on the hidden states
instead (:meth:`Chain.rows`). Any op outside that small algebra raises
:class:`~memgrad_hf.errors.UnsupportedModelError` at once, naming the op: a model is never silently computed
differently from what its own code says.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from memgrad_hf.errors import UnsupportedModelError
from memgrad_hf.kernels.head import Epilogue

aten = torch.ops.aten

# Ops that neither change values nor which tokens/vocab entries are selected.
_PASSTHROUGH = {
    aten.alias.default, aten.detach.default, aten.clone.default, aten.contiguous.default,
    aten._to_copy.default, aten.lift_fresh.default,
}
_MUL = {aten.mul.Tensor, aten.mul.Scalar}
_DIV = {aten.div.Tensor, aten.div.Scalar}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


@dataclass(frozen=True)
class Chain:
    """What has been applied to the logits so far: ``z = post * tanh(pre * u)`` (or ``pre * u``), then a vocab
    slice ``[:vocab_limit]``; ``u`` is the head's output with ``column_ops`` applied in order: ``("mul", s)`` a
    per-word scale (e.g. a learned logit scale inside the head module: folded into the weight's rows), ``("add", c)``
    a per-word bias (e.g. BART's ``final_logits_bias``: folded into the head's bias), both differentiably."""

    pre: float = 1.0
    tanh: bool = False
    post: float = 1.0
    vocab_limit: int | None = None
    column_ops: tuple[tuple[str, torch.Tensor], ...] = field(default=(), compare=False)
    # (aten op, its arguments after the logits) for each op on the token axes, in order: see rows()
    row_ops: tuple[tuple[Any, tuple, dict], ...] = field(default=(), compare=False)

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (``[..., H]``, what the head received) with the forward's token-axis ops on the logits
        (``[..., V]``) replayed, so that its rows are the positions of these logits, in their order."""
        for func, args, kwargs in self.row_ops:
            if func in _VIEWS:
                hidden = hidden.reshape(*list(args[0])[:-1], hidden.shape[-1])
            else:
                hidden = func(hidden, *args, **kwargs)
        return hidden

    def epilogue(self) -> Epilogue:
        if self.tanh:
            return Epilogue(inp=self.pre, tanh=True, out=self.post)
        return Epilogue(inp=self.pre * self.post)

    def scaled(self, factor: float) -> Chain:
        return replace(self, post=self.post * factor) if self.tanh else replace(self, pre=self.pre * factor)


def _scalar(x: Any) -> float | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.Tensor) and not isinstance(x, LogitsProbe) and x.numel() == 1 and not x.requires_grad:
        return float(x.detach().reshape(()).item())
    return None


def _per_word(x: Any, vocab: int) -> bool:
    """A tensor of one value per vocabulary entry, broadcast over the tokens (``[V]``, ``[1, 1, V]``, ...)."""
    return (isinstance(x, torch.Tensor) and not isinstance(x, LogitsProbe) and x.dim() >= 1 and vocab > 1
            and x.shape[-1] == vocab and x.numel() == vocab and x.is_floating_point())


class LogitsProbe(torch.Tensor):
    """Data-less tensor shaped like the logits; see the module docstring."""

    _chain: Chain
    _owner: str
    # ``cross_entropy(probe, target, **kw) -> loss``, set while a patched model trains: models that apply
    # ``nn.CrossEntropyLoss`` to their (unshifted) logits themselves get the chunked loss instead
    _cross_entropy: Any

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, device: torch.device, chain: Chain, owner: str,
                cross_entropy: Any = None):
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        r._chain = chain
        r._owner = owner
        r._cross_entropy = cross_entropy
        return r

    def __repr__(self) -> str:  # never touch data
        return f"LogitsProbe(shape={tuple(self.shape)}, {self._chain})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and args and isinstance(args[0], LogitsProbe) and args[0]._cross_entropy:
            return args[0]._cross_entropy(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probes = [a for a in args if isinstance(a, LogitsProbe)]
        src = probes[0]
        chain = _parse(func, args, kwargs, src)
        if func is aten.index.Tensor:  # how many positions a mask keeps depends on its data: ask a [..., 1] stand-in
            stand_in = torch.zeros((*src.shape[:-1], 1), device=src.device)
            shape = (*func(stand_in, *args[1:], **kwargs).shape[:-1], src.shape[-1])
            return LogitsProbe(torch.Size(shape), src.dtype, src.device, chain, src._owner, src._cross_entropy)
        meta = tree_map(
            lambda a: torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
            if isinstance(a, torch.Tensor) else a,
            (args, kwargs),
        )
        out = func(*meta[0], **meta[1])
        if not isinstance(out, torch.Tensor):
            raise UnsupportedModelError(_unsupported(src._owner, func))
        return LogitsProbe(out.shape, out.dtype, src.device, chain, src._owner, src._cross_entropy)


def _unsupported(owner: str, func: Any) -> str:
    return (
        f"{owner}.forward applies `{func}` to the logits after the LM head; memgrad_hf's chunked head models "
        "only logit scales/multipliers (scalars, or one per word before any softcap), per-word biases, final-logit "
        "softcapping, dtype casts, a vocab slice and selections of token positions, so it cannot "
        "reproduce this model's loss exactly. Use patch_model(model, head=False), or open an issue with the "
        "model class."
    )


def _parse(func: Any, args: tuple, kwargs: dict, src: LogitsProbe) -> Chain:
    chain = src._chain
    if func in _PASSTHROUGH:
        if func is aten._to_copy.default and kwargs.get("device") not in (None, src.device):
            raise UnsupportedModelError(_unsupported(src._owner, func))
        return chain
    if len(args) >= 2 and isinstance(args[0], LogitsProbe) and not isinstance(args[1], LogitsProbe):
        k = _scalar(args[1])
        if k is not None and func in _MUL:
            return chain.scaled(k)
        if k is not None and func in _DIV and k != 0:
            return chain.scaled(1.0 / k)
    column_op = "mul" if func in _MUL else "add" if func is aten.add.Tensor and kwargs.get("alpha", 1) == 1 else None
    # (a bias after a scalar scale would need dividing by it: refused; scales commute with everything before)
    if (column_op and len(args) == 2 and not chain.tanh and chain.vocab_limit is None
            and (column_op == "mul" or chain.pre == 1.0)):
        other = args[1] if isinstance(args[0], LogitsProbe) else args[0]
        if _per_word(other, src.shape[-1]):  # the tensor itself (with its autograd history), not a copy
            return replace(chain, column_ops=(*chain.column_ops, (column_op, other)))
    if func is aten.tanh.default and not chain.tanh and chain.vocab_limit is None:
        return replace(chain, tanh=True)
    if func in _VIEWS and args[1] and int(list(args[1])[-1]) == src.shape[-1]:
        # reshapes that keep the vocab axis (e.g. logits.view(-1, V)) arrange the positions only
        return _on_rows(chain, func, args, kwargs)
    last = src.dim() - 1
    if func is aten.slice.Tensor:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        start = args[2] if len(args) > 2 else kwargs.get("start", None)
        end = args[3] if len(args) > 3 else kwargs.get("end", None)
        step = args[4] if len(args) > 4 else kwargs.get("step", 1)
        if dim % src.dim() != last:  # positions (logits[..., :-1, :])
            return _on_rows(chain, func, args, kwargs)
        if (start in (None, 0)) and step == 1:
            limit = src.shape[-1] if end is None else min(int(end), src.shape[-1])
            return replace(chain, vocab_limit=limit)
    if func is aten.select.int and src.dim() > 1 and args[1] % src.dim() != last:
        return _on_rows(chain, func, args, kwargs)
    if func is aten.index.Tensor and args[0] is src and len(args[1]) <= last and not any(
            isinstance(i, LogitsProbe) for i in args[1]):  # positions by mask or index, the vocab axis whole
        return _on_rows(chain, func, args, kwargs)
    raise UnsupportedModelError(_unsupported(src._owner, func))


def _on_rows(chain: Chain, func: Any, args: tuple, kwargs: dict) -> Chain:
    """``chain`` with a token-axis op of the logits appended, to be replayed on the hidden states."""
    return replace(chain, row_ops=(*chain.row_ops, (func, tuple(args[1:]), dict(kwargs))))
