"""FORGE optimizers: the optimizer step fused into the backward pass.

Importing this package (``import memgrad_hf`` does) registers ``forge_adamw``, ``forge_lion`` and ``forge_sgd`` as
Trainer optimizer names: ``TrainingArguments(optim="forge_adamw")`` or ``--optim forge_adamw`` on the command line.
"""

from memgrad_hf.optim.forge import ForgeAdamW, ForgeLion, ForgeOptimizer, ForgeSGD, forge_optimizer_of
from memgrad_hf.optim.forge_state import to_torch_state_dict
from memgrad_hf.optim.registration import register

register()

__all__ = ["ForgeAdamW", "ForgeLion", "ForgeOptimizer", "ForgeSGD", "forge_optimizer_of", "register",
           "to_torch_state_dict"]
