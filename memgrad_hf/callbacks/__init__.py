"""``TrainerCallback``s shipped with memgrad_hf."""

from memgrad_hf.callbacks.memory import MemoryReportCallback
from memgrad_hf.callbacks.titans import FANDistillationCallback

__all__ = ["FANDistillationCallback", "MemoryReportCallback"]
