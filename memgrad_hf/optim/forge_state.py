"""FORGE's optimizer state in checkpoints: ``state_dict`` / ``load_state_dict``, converting between state dtypes."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from memgrad_hf.kernels import forge as K
from memgrad_hf.kernels.state_codes import LEGACY_DTYPE as LEGACY_8BIT_DTYPE
from memgrad_hf.kernels.state_codes import dequantize_legacy
from memgrad_hf.optim.forge_checks import RESULT_OPTIONS, check_torch_options

CODES = ".codes"  # the suffix of 8-bit state in a state dict (see StateCheckpointing.state_dict)


_RULE_HYPERPARAMETERS = {"adamw": ("betas", "eps"), "lion": ("betas",), "sgd": ("momentum", "dampening", "nesterov"),
                         "sgd_momentum": ("momentum", "dampening", "nesterov")}


class StateCheckpointing:
    """The checkpoint part of :class:`memgrad_hf.optim.forge.ForgeOptimizer`: a resumed run continues exactly."""

    def _restore_state(self, p: Tensor, st: dict[str, Any], name: str, saved: dict[str, Any]) -> None:
        """State ``name`` of ``p`` from its saved tensor, in this optimizer's state dtype: as saved where the dtypes
        agree (exact), else converted through fp32 -- a run resumed with another ``state_dtype``, or 8-bit state
        saved before 2026-11-27 (float8-e4m3 codes, re-encoded in the current codes)."""
        want, kind = self._state_dtype_for(p), saved[name].dtype
        positive = name == "exp_avg_sq"  # 8-bit codes hold sqrt(v)
        scale = saved.get(name + ".scale")
        scale = None if scale is None else scale.to(device=p.device, dtype=torch.float32)
        st.pop(name + ".scale", None)
        if kind == want:  # torch's loaded copy, unless its cast to the weight's dtype changed it
            st[name] = st[name] if st[name].dtype == kind else saved[name].to(p.device, copy=True)
            if scale is not None:
                st[name + ".scale"] = scale
            return
        # the saved values in fp32 (8-bit codes decoded, sqrt(v) squared), then stored as this optimizer keeps them
        if kind in (K.Q_DTYPE, LEGACY_8BIT_DTYPE):
            codes = saved[name].to(p.device)
            x = K.dequantize_8bit(codes, scale, positive) if kind == K.Q_DTYPE else dequantize_legacy(codes, scale)
            x = x.square() if positive else x
        else:
            x = saved[name].to(device=p.device, dtype=torch.float32)
        if want == K.Q_DTYPE:
            st[name], st[name + ".scale"] = K.quantize_8bit(x.sqrt() if positive else x, positive=positive)
        else:
            st[name] = x.to(want)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # 8-bit codes go under "<name>.codes": torch.optim would cast codes under a moment's own name to the
        # weight's dtype and take them as the moment (values 0-255). Under another name it cannot use them: its
        # first step raises KeyError(name) instead of training on wrong state. Convert through fp32 state instead.
        sd["state"] = {i: {(k + CODES if torch.is_tensor(v) and v.dtype == K.Q_DTYPE else k): v for k, v in st.items()}
                       for i, st in sd["state"].items()}
        sd["forge"] = {"skipped_steps": self.skipped_steps, "prev_norm": self._prev_norm}
        return sd

    def _check_saved_shapes(self, p: Tensor, saved: dict[str, Any]) -> None:
        """A saved state tensor must fit its parameter: the update kernels index it as the parameter's shape (a
        checkpoint of another model, or parameters in another order, otherwise wrote out of bounds)."""
        for key, v in saved.items():
            if key == "step" or not isinstance(v, Tensor):
                continue
            want = K.scale_shape(p.shape) if key.endswith(".scale") else p.shape
            fits = tuple(v.shape) == tuple(want) or (key.endswith(".scale") and v.numel() == math.prod(want))
            if not fits:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: the saved {key.removesuffix(CODES)!r} has shape "
                    f"{tuple(v.shape)}, but its parameter is {tuple(p.shape)}: the checkpoint belongs to another model "
                    "(other layers, another Titans or LoRA configuration) or lists its parameters in another order."
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("forge", {})
        state_dict["state"] = {i: {k.removesuffix(CODES): v for k, v in st.items()}
                               for i, st in state_dict.get("state", {}).items()}
        name = type(self).__name__
        for group in state_dict.get("param_groups", ()):  # e.g. a torch AdamW's, saved with amsgrad=True
            check_torch_options(name, {k: v for k, v in group.items() if k in RESULT_OPTIONS})
        needed = set(K.RULES[self.rule][1])
        sgd = self.rule.startswith("sgd")  # (its momentum buffer appears once momentum is on)
        kept = needed | ({"momentum_buffer"} if sgd else set())
        allowed = {"step"} | kept | {f"{n}.scale" for n in kept}
        for saved in state_dict.get("state", {}).values():
            if saved and ((not sgd and not needed <= set(saved)) or not set(saved) <= allowed):
                raise ValueError(
                    f"{name}.load_state_dict: the saved state holds {sorted(k for k in saved if k != 'step')} per "
                    f"parameter, not the {sorted(kept)} this optimizer keeps: it was saved by another optimizer "
                    "(e.g. Lion's state loaded into AdamW, or AdamW's into Lion)."
                )
        saved_groups = state_dict.get("param_groups", ())
        sizes, own = [len(g["params"]) for g in saved_groups], [len(g["params"]) for g in self.param_groups]
        if sizes != own:
            raise ValueError(
                f"{name}.load_state_dict: the checkpoint's optimizer holds parameter groups of {sizes} parameters, "
                f"this one {own}: the checkpoint belongs to a model with other trainable parameters (Titans memory "
                "added or removed, another LoRA configuration, other frozen layers)."
            )
        ids = [i for g in saved_groups for i in g["params"]]
        for i, p in zip(ids, [p for g in self.param_groups for p in g["params"]], strict=True):
            self._check_saved_shapes(p, state_dict.get("state", {}).get(i, {}))
        hyper = {"lr", "weight_decay", *_RULE_HYPERPARAMETERS[self.rule]}  # what the update reads from a group
        for group in state_dict.get("param_groups", ()):
            if hyper - set(group):  # e.g. SGD's momentum: the update would fail inside the next backward
                raise ValueError(
                    f"{name}.load_state_dict: the saved parameter groups lack {sorted(hyper - set(group))}, which "
                    f"{name} needs: they were saved by another optimizer."
                )
        super().load_state_dict(state_dict)
        self._plans = {}  # they point at the state tensors just replaced
        for st in self.state.values():  # torch SGD keeps no step: its buffer is past the first step's initialisation
            if "momentum_buffer" in st and "step" not in st:
                st["step"] = torch.tensor(1.0)
        # torch.optim casts floating state to each parameter's dtype on load (fp32 state of a bf16 weight would lose
        # bits): every state tensor is taken again from the saved one, in the configured state dtype
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params, strict=True):
            st = self.state.get(p)
            for name in K.RULES[self.rule][1]:
                if st and name in st:
                    self._restore_state(p, st, name, state_dict["state"][i])
        self.skipped_steps = extra.get("skipped_steps", 0)
        self._prev_norm = extra.get("prev_norm")


def to_torch_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A FORGE optimizer's ``state_dict()`` as ``torch.optim.AdamW`` / ``SGD`` take it: 8-bit state decoded (and
    ``sqrt(v)`` squared) and bf16 state widened, to fp32 tensors under torch's names; FORGE's own entry dropped. For
    continuing a FORGE run under a torch optimizer: torch cannot read 8-bit codes (its first step raises
    ``KeyError: 'exp_avg'``). fp32 state passes unchanged, so such a resume is exact.

    Example::

        path = "out/checkpoint-500/optimizer.pt"
        torch.save(to_torch_state_dict(torch.load(path)), path)   # then resume with optim="adamw_torch"
    """
    out = {k: v for k, v in state_dict.items() if k != "forge"}
    out["state"] = {}
    for i, st in state_dict.get("state", {}).items():
        new = {}
        for key, v in st.items():
            name = key.removesuffix(CODES)
            if key.endswith(".scale") or not isinstance(v, Tensor):
                if not key.endswith(".scale"):
                    new[key] = v
                continue
            if v.dtype in (K.Q_DTYPE, LEGACY_8BIT_DTYPE):
                scale, positive = st[name + ".scale"].float(), name == "exp_avg_sq"
                x = K.dequantize_8bit(v, scale, positive) if v.dtype == K.Q_DTYPE else dequantize_legacy(v, scale)
                new[name] = x.square() if positive else x
            else:
                new[name] = v.float() if v.is_floating_point() and name != "step" else v
        out["state"][i] = new
    return out
