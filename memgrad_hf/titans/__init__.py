"""Titans neural-memory layers with exact manual inner-gradient kernels.

Example::

    from memgrad_hf.titans import NeuralMemory
    mem = NeuralMemory(512, heads=8, chunk_size=64)
    retrieved, state = mem(x)
"""

from memgrad_hf.kernels.titans import memory_forward, memory_step, memory_step_autograd
from memgrad_hf.titans.branch import GatedMemoryBranch
from memgrad_hf.titans.config import TitansConfig
from memgrad_hf.titans.fan import FAN
from memgrad_hf.titans.io import from_pretrained, load_titans, save_titans, titans_state_dict
from memgrad_hf.titans.memory import NeuralMemory, NeuralMemState

__all__ = [
    "FAN", "GatedMemoryBranch", "NeuralMemState", "NeuralMemory", "TitansConfig", "from_pretrained", "load_titans",
    "memory_forward", "memory_step", "memory_step_autograd", "save_titans", "titans_state_dict",
]
