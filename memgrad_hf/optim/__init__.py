"""FORGE optimizers: the optimizer step fused into the backward pass.

Importing this package (``import memgrad_hf`` does) registers ``forge_adamw`` and ``forge_lion`` as Trainer
optimizer names: ``TrainingArguments(optim="forge_adamw")`` or ``--optim forge_adamw`` on the command line.
"""

from memgrad_hf.optim.forge import ForgeAdamW, ForgeLion, ForgeOptimizer, ForgeSGD
from memgrad_hf.optim.forge_state import to_torch_state_dict
from memgrad_hf.optim.registration import register

register()

__all__ = ["ForgeAdamW", "ForgeLion", "ForgeOptimizer", "ForgeSGD", "register", "to_torch_state_dict"]
