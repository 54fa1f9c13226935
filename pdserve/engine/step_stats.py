"""What the engine measures of its own steps for predicted-TTFT routing: its prefill
throughput and the prompt tokens still to prefill, plain numbers a heartbeat thread reads.

A step's wall time is modelled as ``base_s + num_prefill_tokens / rate``: ``base_s`` is
what a step costs without prefill tokens, measured on decode-only steps; the rate is the
marginal one a prefill adds (a few prompt tokens riding along a decode batch are not a
slow prefill), but charged at least the prefill's share of the step's rows (a few rows
cost what one does: a 45-token prefill's margin over a one-row step said nothing of a long
prompt). The first step is not measured: it pays one-time costs.
"""

from __future__ import annotations

import math

from pdserve.engine.scheduler import Scheduler, SchedulerOutput

#: Weight of the newest decode-only step in the moving average of ``base_s``.
BASE_EMA_WEIGHT = 0.2
#: Prefill steps are averaged over roughly this many of the latest prefilled tokens (an
#: older step's weight decays by ``exp(-tokens since / PREFILL_WINDOW_TOKENS)``).
PREFILL_WINDOW_TOKENS = 2048
#: The marginal prefill time is at least this share of the prefill steps' time (guards
#: against a noisy ``base_s`` larger than a small prefill step).
MIN_MARGINAL_SHARE = 0.1


class PrefillStats:
    """Prefill rate and backlog, updated once per step (:meth:`observe`).

    Attributes:
        step_base_s: moving average of decode-only steps' wall time (s; 0: none yet).
        prefill_tokens_per_s: prefill tokens per second of step time beyond
            ``step_base_s``, at least the prefill's share of the rows (0: none yet).
        num_prefill_tokens_queued: prompt tokens not yet prefilled after the last step
            (waiting requests and the rest of partly prefilled ones).
        num_prefill_tokens_computed: prompt tokens this engine has run through the model
            (prefix-cache hits and KV installed from a prefill worker excluded; prompts
            recomputed after a preemption, a failed transfer or a migration included).
    """

    def __init__(self) -> None:
        self.step_base_s = 0.0
        self.prefill_tokens_per_s = 0.0
        self.num_prefill_tokens_queued = 0
        self.num_prefill_tokens_computed = 0
        self._is_first_step = True
        # decayed sums over prefill steps: seconds, tokens, steps
        self._sum_s = self._sum_tokens = self._num_steps = 0.0
        self._sum_share_s = 0.0  # decayed: step time x the prefill's share of its rows

    def observe(self, sched: SchedulerOutput, scheduler: Scheduler, step_s: float) -> None:
        """Fold in one step that ran ``sched`` in ``step_s`` seconds (after the scheduler
        advanced its requests)."""
        num_prefill = sched.num_prefill_tokens
        self.num_prefill_tokens_computed += num_prefill
        if self._is_first_step:
            self._is_first_step = False
        elif num_prefill == 0:
            old = self.step_base_s
            self.step_base_s = step_s if old <= 0 else old + BASE_EMA_WEIGHT * (step_s - old)
        else:
            keep = math.exp(-num_prefill / PREFILL_WINDOW_TOKENS)
            rows = max(sum(s.num_new_tokens for s in sched.scheduled), num_prefill)
            self._sum_share_s = keep * self._sum_share_s + step_s * num_prefill / rows
            self._sum_s = keep * self._sum_s + step_s
            self._sum_tokens = keep * self._sum_tokens + num_prefill
            self._num_steps = keep * self._num_steps + 1
        if self._sum_tokens > 0:
            marginal_s = max(self._sum_s - self.step_base_s * self._num_steps,
                             self._sum_share_s, MIN_MARGINAL_SHARE * self._sum_s)
            self.prefill_tokens_per_s = self._sum_tokens / marginal_s
        self.num_prefill_tokens_queued = sum(
            r.num_tokens - r.num_computed_tokens
            for queue in (scheduler.waiting, scheduler.running) for r in queue
            if r.num_tokens - r.num_computed_tokens > 1)
