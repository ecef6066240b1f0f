"""``MemoryReportCallback``: peak memory and throughput in the Trainer's logs."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers import TrainerCallback

from memgrad_hf import memory

logger = logging.getLogger(__name__)
# transformers' per-step warning when it is asked to count tokens and a batch has no ``input_ids``
_NO_INPUT_IDS = "Tried to track the number of tokens seen"


class _UncountedBatches(logging.Filter):
    """Drops transformers' per-step token-count warning (counting was our idea, not the user's).

    TRL's GRPO / RLOO batches are prompts, not ``input_ids``: those trainers count tokens themselves, and
    transformers would warn at every step that it cannot."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NO_INPUT_IDS)


class MemoryReportCallback(TrainerCallback):
    """Adds ``peak_mem_mb``, ``peak_added_mem_mb``, ``step_time_s`` and ``tokens_per_s`` to every Trainer log.

    Peak memory is the CUDA caching allocator's peak (``torch.cuda.max_memory_allocated``) on a GPU and the
    process's peak resident set (``VmHWM``, reset when training starts) on CPU; ``peak_added_mem_mb`` is that peak
    minus what was in use when training started (model, data). Token counting switches the Trainer's
    ``include_num_input_tokens_seen`` on if it was off (TRL's GRPO / RLOO count tokens themselves); where no token is
    counted at all (batches without ``input_ids``), ``tokens_per_s`` is left out and a warning says so once. Tokens
    are counted as the Trainer counts them (``"all"``: padding included, unless you set ``"non_padding"``), and
    ``tokens_per_s`` is those tokens over the time spent in training steps (``step_time_s``'s time: evaluation,
    logging and saving between steps left out); evaluation logs get the peaks only. After training,
    :attr:`summary` holds the run's totals: the peaks, the median step time and the throughput at that median step
    time (tokens per step over it), both without the first step (which pays one-off costs such as kernel
    compilation).

    Example::

        from memgrad_hf.callbacks import MemoryReportCallback
        report = MemoryReportCallback()
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[report])
        trainer.train()
        print(report.summary)  # every log entry also carries peak_mem_mb, peak_added_mem_mb, ...
    """

    def __init__(self) -> None:
        self.summary: dict[str, float] = {}
        self._device: torch.device = torch.device("cpu")
        self._base = 0
        self._t_step = 0.0
        self._step_times: list[float] = []
        self._since_log: list[float] = []
        self._tokens0 = 0
        self._tokens_at_log = 0
        self._tokens_after_first: int | None = None  # tokens seen at the end of the first step
        self._uncounted: _UncountedBatches | None = None  # set when we switched token counting on
        self._said_uncounted = False

    def _count_tokens(self, args: Any) -> None:
        if getattr(args, "include_num_input_tokens_seen", "no") in ("no", False):
            args.include_num_input_tokens_seen = "all"
            self._uncounted = _UncountedBatches()

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._count_tokens(args)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._count_tokens(args)  # (again: a callback added by trainer.add_callback() never saw on_init_end)
        self._device = torch.device(args.device) if getattr(args, "device", None) is not None else self._device
        self._base = memory.current_bytes(self._device) or 0
        memory.reset_peak(self._device)
        self._tokens0 = self._tokens_at_log = state.num_input_tokens_seen
        self._step_times.clear()
        self._since_log.clear()
        self._tokens_after_first = None
        self._said_uncounted = False
        if self._uncounted is not None:
            logging.getLogger("transformers.trainer").addFilter(self._uncounted)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._t_step = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        dt = time.perf_counter() - self._t_step
        self._step_times.append(dt)
        self._since_log.append(dt)
        if self._tokens_after_first is None:
            self._tokens_after_first = state.num_input_tokens_seen

    def _metrics(self, state: Any) -> dict[str, float]:
        peak = memory.peak_bytes(self._device) or 0
        out = {
            "peak_mem_mb": round(peak / memory.MiB, 1),
            "peak_added_mem_mb": round(max(peak - self._base, 0) / memory.MiB, 1),
        }
        if self._since_log:  # steps ran since the last log (not an evaluation's log)
            out["step_time_s"] = round(sum(self._since_log) / len(self._since_log), 4)
            if self._tokens_counted(state):
                out["tokens_per_s"] = round((state.num_input_tokens_seen - self._tokens_at_log)
                                            / max(sum(self._since_log), 1e-9), 1)
        return out

    def _tokens_counted(self, state: Any) -> bool:
        """False when steps ran and no token was counted: the batches carried no ``input_ids`` and the trainer did
        not count tokens itself either (a rate of 0 would be wrong)."""
        if not self._step_times or state.num_input_tokens_seen > self._tokens0:
            return True
        if not self._said_uncounted:  # once per run, not at every log
            logger.warning("MemoryReportCallback: tokens_per_s is left out: the training batches carry no "
                           "`input_ids` to count. Setting the model's `main_input_name` to a key shaped [batch, "
                           "tokens] (e.g. 'attention_mask') makes the Trainer count them; not 'inputs_embeds', whose "
                           "every element would count as a token.")
            self._said_uncounted = True
        return False

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        m = self._metrics(state)
        if self._since_log:
            self._since_log.clear()
            self._tokens_at_log = state.num_input_tokens_seen
        if logs is not None:
            logs.update(m)
        # The Trainer appended its copy of these logs before calling us; keep log_history complete too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(m)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._uncounted is not None:
            logging.getLogger("transformers.trainer").removeFilter(self._uncounted)
        m = self._metrics(state)
        m.pop("tokens_per_s", None)
        times = sorted(self._step_times[1:] or self._step_times)  # the first step pays one-off costs
        median = times[len(times) // 2] if times else float("nan")
        m["step_time_s"] = round(median, 4)
        m["steps"] = len(self._step_times)
        if self._step_times and self._tokens_counted(state):
            warm = len(self._step_times) > 1 and self._tokens_after_first is not None
            n0 = self._tokens_after_first if warm else self._tokens0
            per_step = (state.num_input_tokens_seen - n0) / len(times)
            # at the median step time, as step_time_s: a mean over all step times let a few stalled steps make a
            # faster configuration's throughput the lower one in a table beside its step time
            m["tokens_per_s"] = round(per_step / max(median, 1e-9), 1)
        self.summary = m
