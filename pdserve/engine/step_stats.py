"""What the engine measures of its own steps for the router's predicted-TTFT routing: its
prefill throughput and the prompt tokens still to prefill, kept as plain numbers that a
heartbeat thread may read at any time."""

from __future__ import annotations

from pdserve.engine.scheduler import Scheduler, SchedulerOutput

#: Weight of the newest step in the moving average of the prefill rate.
EMA_WEIGHT = 0.2


class PrefillStats:
    """Prefill rate and backlog, updated once per step (:meth:`observe`).

    Attributes:
        prefill_tokens_per_s: moving average of prompt tokens per second of step wall time
            over steps that prefilled (decode rows in the same step included in the time);
            0 until the first such step.
        num_prefill_tokens_queued: prompt tokens not yet prefilled after the last step
            (waiting requests and the rest of partly prefilled ones).
    """

    def __init__(self) -> None:
        self.prefill_tokens_per_s = 0.0
        self.num_prefill_tokens_queued = 0

    def observe(self, sched: SchedulerOutput, scheduler: Scheduler, step_s: float) -> None:
        """Fold in one step that ran ``sched`` in ``step_s`` seconds (after the scheduler
        advanced its requests)."""
        num_prefill = sum(s.num_new_tokens for s in sched.scheduled[sched.num_decodes:])
        if num_prefill and step_s > 0:
            sample = num_prefill / step_s
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = sample if old <= 0 else old + EMA_WEIGHT * (sample - old)
        self.num_prefill_tokens_queued = sum(
            r.num_tokens - r.num_computed_tokens
            for queue in (scheduler.waiting, scheduler.running) for r in queue
            if r.num_tokens - r.num_computed_tokens > 1)
