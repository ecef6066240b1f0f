"""``TrainerCallback``s shipped with memgrad_hf."""

from memgrad_hf.callbacks.memory import MemoryReportCallback

__all__ = ["MemoryReportCallback"]
