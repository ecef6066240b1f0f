"""Forward Alignment Networks (FANs): a learned predictor of a Titans memory's inner gradient.

A :class:`~memgrad_hf.titans.NeuralMemory` updates its MLP ``M`` by the gradient of
``L = sum_t lr_t * mean_d (M(k_t) - v_t)^2`` inside the forward pass. The exact gradient needs a backward through
the memory's LayerNorm and MLP (:func:`memgrad_hf.kernels.titans.memory_step`). A FAN replaces that backward with a
small network that sees only forward quantities.

How it predicts. The weight gradients of the memory MLP are sums over tokens of outer products,
``dW_i = sum_t A_{i,t}^T G_{i,t}``, with the forward activations ``A_i`` (``A_0 = k``, ``A_i = act(Z_{i-1})``) and
per-token error signals ``G_i`` that depend only on that token's forward pass, and ``G_i`` is proportional to the
token's ``lr_t``. So the FAN predicts, per token, one error signal per memory layer from the forward features
``[k, v, y, k - v, k * v]`` (``y = M(k)``, 5 x ``dim_head`` inputs), and the gradient is assembled exactly like the
true one: ``dW_i ~ A_i^T (lr * G_hat_i)``. The FAN is one MLP shared by every head (every ``batch x head`` memory).

``dgamma`` (the LayerNorm gain offset) is not predicted: its exact gradient ``sum_t dY_t * H_t`` with
``dY = (2/D) lr (Y - V)`` needs only the forward (the normalized ``H`` and the output ``Y``), so it costs no
backward and is computed exactly.

How it learns (distillation). While :attr:`FAN.distilling` is on, the memory keeps using the exact gradient and, at
every exact call, hands it to :meth:`FAN.observe`. The FAN predicts from *detached* features and is trained on
``mean(1 - cos(dW_hat_i, dW_i)) + norm_weight * mean((log|dW_hat_i| - log|dW_i|)^2)`` over memories and layers
(cosine for the direction; the log-norm term so that the predicted magnitude is usable as a step). That loss rides
on the memory's output through :func:`attach_loss`: the output is returned unchanged, and its backward also sends
``loss_coef`` into the FAN loss, so the ordinary Trainer optimizer trains the FAN and the model's loss is unchanged.
The FAN's parameters get gradients only from that loss.
"""

from __future__ import annotations

import logging
from collections import deque

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memgrad_hf.engine import REUSED_PER_FORWARD
from memgrad_hf.kernels import titans as K

_EPS = 1e-12
_FP16_WARNED: list[bool] = []  # said once per process
logger = logging.getLogger(__name__)


class _AttachLoss(torch.autograd.Function):
    """Identity on ``output``; in backward, also the gradient ``coef`` for the scalar ``aux``."""

    @staticmethod
    def forward(ctx, output: Tensor, aux: Tensor, coef: float) -> Tensor:  # type: ignore[override]
        ctx.coef = coef
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad_output, torch.full(shape, ctx.coef, dtype=dtype, device=device), None


def attach_loss(output: Tensor, aux: Tensor, coef: float = 1.0) -> Tensor:
    """``output`` unchanged, with the scalar ``aux`` attached: any backward through the result also minimizes
    ``coef * aux``. How an auxiliary loss computed deep inside a forward is trained by the caller's optimizer
    without changing what the forward returns (or the loss the caller reports).

    Example::

        y = attach_loss(y, aux_loss, 0.5)   # y's values are unchanged; loss(y).backward() also back-propagates 0.5*aux
    """
    if not aux.requires_grad:
        return output
    return _AttachLoss.apply(output, aux, coef)


class FAN(nn.Module):
    """Forward Alignment Network: predicts a Titans memory's per-token error signals from forward features.

    Args:
        dim_head: width ``D`` of the memory's keys, values and output.
        widths: output widths of the memory MLP's layers (``widths[1:]`` of the memory; one error signal each).
        hidden: hidden width of the FAN (default ``4 * dim_head``).
        norm_weight: weight of the log-norm matching term in the distillation loss (0: cosine only).
        loss_coef: gradient sent into the distillation loss by :func:`attach_loss` (the loss's weight in the
            backward). Small by default: Adam-type optimizers (AdamW, Lion, FORGE) are invariant to the scale of a
            parameter's gradient, so the FAN learns just as fast, while its gradients stay negligible in the
            Trainer's global gradient norm (clipping by ``max_grad_norm`` would otherwise shrink the model's own
            update). With plain SGD raise it (e.g. to 1).
        local_derivative: multiply the predicted signal of each hidden layer by the activation's derivative at
            that layer's pre-activation (an elementwise forward quantity, as in the true backward's
            ``G_{i-1} = (G_i W_i^T) * act'(Z_{i-1})``): the FAN then predicts only ``G_i W_i^T``. At depth 2 this
            raised the first layer's cosine from about 0.60 to 0.67 on a synthetic task (last layer: 0.90 either
            way).
        window: how many recent distillation calls :attr:`cosine` averages.

    Attributes:
        distilling: when on (and the memory uses an exact gradient, in training), :meth:`observe` trains the FAN.
        frozen: set by ``fan.requires_grad_(False)`` (cleared by ``requires_grad_(True)``): the prediction then uses
            detached parameters, so the FAN stays frozen even where its parameters' flags are switched back on
            behind its back (PEFT's ``disable_adapter()`` re-enables every parameter of a ``modules_to_save`` copy
            on exit).
        calls: how many chunks were computed with the FAN's predicted gradient (:meth:`memory_step`).
        distill_calls: how many exact gradients the FAN was trained on.
        accumulation_steps: micro-batches per optimizer step (1; :class:`FANDistillationCallback` sets the
            Trainer's ``gradient_accumulation_steps`` while it trains): the attached loss is divided by it, as the
            Trainer divides the model's loss, so a step's distillation gradient is the mean over its micro-batches.

    Example::

        mem = NeuralMemory(64, heads=2, fan=True)     # mem.fan = FAN(32, [128, 32])
        mem.fan.distilling = True                      # train alongside the exact gradient ...
        loss = task_loss(mem(x)[0]); loss.backward()   # ... the FAN's parameters get only the distillation grads
        print(mem.fan.cosine)                          # running cosine(predicted, exact gradient)
        mem.fan.distilling, mem.grad_impl = False, "fan"   # then use the prediction: no exact gradient any more
    """

    def __init__(self, dim_head: int, widths: list[int], *, hidden: int | None = None, norm_weight: float = 0.1,
                 loss_coef: float = 0.01, local_derivative: bool = True, window: int = 50) -> None:
        super().__init__()
        if not widths:
            raise ValueError("FAN: widths must list the output width of every memory layer (at least one).")
        self.dim_head, self.widths = dim_head, list(widths)
        hidden = hidden or 4 * dim_head
        # Initialized from a forked RNG: adding a FAN leaves the initialization of everything built after it (the
        # rest of the model) unchanged, so runs with and without a FAN start from the same model.
        with torch.random.fork_rng(devices=[]):
            self.net = nn.Sequential(nn.Linear(5 * dim_head, hidden), nn.GELU(), nn.Linear(hidden, sum(self.widths)))
            for layer in self.net[0], self.net[2]:  # run once per chunk: FORGE applies their summed gradient
                setattr(layer, REUSED_PER_FORWARD, True)
        self.norm_weight, self.loss_coef, self.local_derivative = norm_weight, loss_coef, local_derivative
        self.distilling = False
        self.frozen = False
        self.calls = 0
        self.distill_calls = 0
        self.accumulation_steps = 1
        self._recent: deque[Tensor] = deque(maxlen=window)
        self._recent_layers: deque[Tensor] = deque(maxlen=window)

    def requires_grad_(self, requires_grad: bool = True) -> FAN:
        self.frozen = not requires_grad
        return super().requires_grad_(requires_grad)

    # -- prediction -----------------------------------------------------------------------------------------------
    def features(self, k: Tensor, v: Tensor, y: Tensor) -> Tensor:
        """Per-token FAN input ``[k, v, y, k - v, k * v]``: ``(G, C, 5 * D)``."""
        return torch.cat([k, v, y, k - v, k * v], dim=-1)

    def error_signals(self, k: Tensor, v: Tensor, y: Tensor) -> list[Tensor]:
        """Predicted per-token error signal of every memory layer, ``[(G, C, widths[i])]`` (before ``lr``)."""
        x = self.features(k, v, y).to(self.net[0].weight.dtype)
        if self.frozen:
            out = torch.func.functional_call(self.net, {n: p.detach() for n, p in self.net.named_parameters()}, (x,))
        else:
            out = self.net(x)
        out = out.to(k.dtype)
        return list(out.split(self.widths, dim=-1))

    def predict(self, weights: list[Tensor] | tuple[Tensor, ...], gamma: Tensor, k: Tensor, v: Tensor, lr: Tensor,
                q: Tensor | None = None, activation: str = "gelu",
                ) -> tuple[list[Tensor], Tensor, Tensor | None]:
        """Predicted ``(weight_grads, gamma_grad, retrieved)`` for one chunk (shapes as ``memory_step``).

        ``dW_i = A_i^T (lr * G_hat_i)`` with the memory's own forward activations ``A_i``; ``dgamma`` is the exact
        forward-only formula; ``retrieved`` is ``M(q)`` (one forward over keys and queries) or ``None``.
        """
        if len(weights) != len(self.widths):
            raise ValueError(f"FAN: built for a memory of depth {len(self.widths)}; got {len(weights)} weights.")
        G, C, D = k.shape
        x = k if q is None else torch.cat([k, q], dim=1)
        m, zs = K.mlp_forward(list(weights), x, activation)
        h = F.layer_norm(m, (D,), eps=K.LN_EPS)
        y = h * ((gamma if gamma.dim() == 1 else gamma[:, None, :]) + 1) + x
        retrieved = None if q is None else y[:, C:]
        y, h = y[:, :C], h[:, :C]
        dgamma = (y - v).mul((lr * (2.0 / D))[..., None]).mul(h).sum(1)  # exact: sum_t dY_t * H_t
        signals = self.error_signals(k, v, y)
        grads = []
        for i, g_hat in enumerate(signals):
            a = k if i == 0 else K.apply_activation(zs[i - 1][:, :C], activation)
            if i < len(signals) - 1 and self.local_derivative:
                g_hat = K.activation_backward(g_hat, zs[i][:, :C], activation)
            grads.append(torch.bmm(a.transpose(1, 2), g_hat * lr[..., None]))
        return grads, dgamma, retrieved

    def memory_step(self, weights: list[Tensor] | tuple[Tensor, ...], gamma: Tensor, k: Tensor, v: Tensor,
                    lr: Tensor, q: Tensor | None = None, activation: str = "gelu",
                    ) -> tuple[list[Tensor], Tensor, Tensor | None]:
        """The memory's inner step with the predicted gradient (what ``grad_impl="fan"`` calls); counts
        :attr:`calls`. Differentiable: the outer gradient flows through the prediction to keys, values, lr and
        the memory weights (and to the FAN's parameters unless they are frozen)."""
        self.calls += 1
        return self.predict(weights, gamma, k, v, lr, q, activation)

    # -- distillation ---------------------------------------------------------------------------------------------
    def distill_loss(self, weights: list[Tensor] | tuple[Tensor, ...], gamma: Tensor, k: Tensor, v: Tensor,
                     lr: Tensor, exact_grads: list[Tensor], activation: str = "gelu") -> tuple[Tensor, Tensor]:
        """``(loss, per-layer mean cosine)`` of the prediction against ``exact_grads``; inputs are detached, so
        the loss reaches only the FAN's parameters."""
        det = lambda t: t.detach()
        pred, _, _ = self.predict([det(w) for w in weights], det(gamma), det(k), det(v), det(lr), None, activation)
        cos_layers, lognorm = [], []
        for p, e in zip(pred, exact_grads, strict=True):
            p, e = p.flatten(1).float(), det(e).flatten(1).float()  # one vector per memory
            pn, en = p.norm(dim=1), e.norm(dim=1)
            cos_layers.append((p * e).sum(1) / (pn * en).clamp_min(_EPS))
            lognorm.append((pn.clamp_min(_EPS).log() - en.clamp_min(_EPS).log()).pow(2))
        cos = torch.stack(cos_layers)  # (L, G)
        loss = (1 - cos).mean() + self.norm_weight * torch.stack(lognorm).mean()
        return loss, cos.detach().mean(1)

    def observe(self, weights: list[Tensor] | tuple[Tensor, ...], gamma: Tensor, k: Tensor, v: Tensor, lr: Tensor,
                exact_grads: list[Tensor], activation: str = "gelu", attach_to: Tensor | None = None,
                ) -> Tensor | None:
        """Distillation on one exact inner gradient: computes :meth:`distill_loss`, records the cosine, and returns
        ``attach_to`` unchanged in value with the loss attached (:func:`attach_loss`), so the backward of whatever
        uses it trains the FAN. With ``attach_to=None`` nothing is trained (the cosine is still recorded)."""
        with torch.enable_grad():
            loss, cos = self.distill_loss(weights, gamma, k, v, lr, exact_grads, activation)
        self.distill_calls += 1
        self._recent_layers.append(cos)
        self._recent.append(cos.mean())
        if attach_to is None:
            return None
        return attach_loss(attach_to, loss, self.loss_coef / self.accumulation_steps)

    def check_autocast(self, device_type: str) -> None:
        """Warn (once per process) when distillation runs under fp16 autocast, i.e. with a loss scaler."""
        if _FP16_WARNED or not (torch.is_autocast_enabled(device_type)
                                and torch.get_autocast_dtype(device_type) == torch.float16):
            return
        _FP16_WARNED.append(True)
        logger.warning("FAN distillation under fp16 autocast: a GradScaler scales the model's loss but not the FAN's "
                       "distillation loss (its gradient is the fixed loss_coef), so unscaling divides the FAN's "
                       "gradient by the loss scale and it barely learns. Distil under bf16 autocast (no scaler) or in "
                       "fp32.")

    @property
    def cosine(self) -> float:
        """Mean cosine(predicted, exact) weight gradient over the recent distillation calls (nan before any)."""
        return torch.stack(list(self._recent)).mean().item() if self._recent else float("nan")

    @property
    def cosine_per_layer(self) -> list[float]:
        """:attr:`cosine` for each memory layer (first to last)."""
        if not self._recent_layers:
            return [float("nan")] * len(self.widths)
        return torch.stack(list(self._recent_layers)).mean(0).tolist()

    def recent_cosines(self) -> list[list[float]]:
        """The window :attr:`cosine` averages: ``[[cosine], [per layer...]]`` (a checkpoint's copy)."""
        return [[float(c) for c in self._recent], [float(c) for t in self._recent_layers for c in t.tolist()]]

    def restore_cosines(self, window: list[list[float]]) -> None:
        """Put back a window saved by :meth:`recent_cosines` (a resumed run reports as the uninterrupted one)."""
        self.reset_stats()
        overall, layers = window
        width, dev = len(self.widths), next(self.parameters()).device  # (stacked with the new ones: same device)
        self._recent.extend(torch.tensor(c, device=dev) for c in overall)
        self._recent_layers.extend(torch.tensor(layers[i:i + width], device=dev) for i in range(0, len(layers), width))

    def reset_stats(self) -> None:
        """Forget the recent cosines (the counters are kept)."""
        self._recent.clear()
        self._recent_layers.clear()

    def extra_repr(self) -> str:
        return f"dim_head={self.dim_head}, widths={self.widths}, norm_weight={self.norm_weight}"
