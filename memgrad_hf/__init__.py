"""memgrad_hf: memory-lean training for Hugging Face Transformers, Trainer and TRL.

Example::

    import memgrad_hf
    model = memgrad_hf.patch_model(model)   # chunked LM head: no [tokens x vocab] logits in training
    memgrad_hf.unpatch_model(model)         # exact undo
"""

from memgrad_hf import functional, optim  # optim: registers forge_* with transformers
from memgrad_hf.errors import UnsupportedModelError
from memgrad_hf.patches import is_head_patched, patch_model, unpatch_model

__version__ = "0.1.0"

_SUBMODULES = ("callbacks", "grpo", "kernels", "patches", "titans")  # imported on first use (TRL, Titans: not needed
# by every user), so that ``import memgrad_hf; memgrad_hf.grpo.patch_trl()`` works as ``import memgrad_hf.grpo`` does


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"memgrad_hf.{name}")
    raise AttributeError(f"module 'memgrad_hf' has no attribute {name!r}")

__all__ = ["UnsupportedModelError", "functional", "is_head_patched", "optim", "patch_model", "unpatch_model",
           "__version__"]
