"""``TitansConfig``: which decoder layers get a neural-memory branch, and the memory's settings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TitansConfig:
    """Settings for ``patch_model(model, titans=TitansConfig(...))``.

    Args:
        layers: indices of the decoder layers that get a memory branch (negative indices count from the end).
        heads, dim_head, depth, expansion, activation, chunk_size, momentum, forget, grad_impl, max_lr: passed to
            :class:`memgrad_hf.titans.NeuralMemory` (``dim`` is the model's hidden size).
        fan: give each memory a :class:`memgrad_hf.titans.FAN` (for ``FANDistillationCallback``).
        fan_frozen: the FANs do not train (``requires_grad=False``). Set by ``FANDistillationCallback`` when it
            switches with ``freeze_fan_after=True``, so that a saved model reloads its FANs frozen as they were.

    Example::

        from memgrad_hf.titans import TitansConfig
        memgrad_hf.patch_model(model, titans=TitansConfig(layers=[2, 4, 6], heads=4, chunk_size=64))
    """

    layers: list[int] = field(default_factory=lambda: [-1])
    heads: int = 1
    dim_head: int | None = None
    depth: int = 2
    expansion: int = 4
    activation: str = "gelu"
    chunk_size: int = 64
    momentum: bool = True
    forget: bool = True
    grad_impl: str = "manual"
    max_lr: float = 0.1
    fan: bool = False
    fan_frozen: bool = False

    def __post_init__(self) -> None:
        # (the memory's own settings are checked by NeuralMemory; this one is the config's alone)
        if not isinstance(self.fan_frozen, bool):
            raise ValueError(f"TitansConfig: fan_frozen must be True or False; got {self.fan_frozen!r}.")

    def memory_kwargs(self) -> dict[str, Any]:
        """The :class:`NeuralMemory` keyword arguments (everything but ``layers`` and ``fan_frozen``)."""
        kw = asdict(self)
        kw.pop("layers")
        kw.pop("fan_frozen")
        return kw

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
