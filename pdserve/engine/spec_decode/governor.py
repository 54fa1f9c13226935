"""Drafting on or off by measured throughput: speculation that never costs tokens/s."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: On-samples a batch size collects before drafting is ever turned off there: enough to
#: span a phase of the text (a request's first tokens after its prompt are often drafted
#: badly, see :class:`SpecGovernor`); paid once per batch size and process.
WARMUP_SAMPLES = 32
#: Samples a mode needs before its rate is compared.
MIN_SAMPLES = 3
#: Least weight of a new sample in a mode's averages (the first ``1 / EMA_ALPHA`` samples
#: are averaged evenly, later ones with this weight): rates over ~100 steps, longer than
#: the text's phases of good and bad acceptance (10-60 steps on W2's random prompts).
EMA_ALPHA = 0.01
#: Decisions between two probes of the mode not in use, at first and at most.
PROBE_EVERY = (32, 256)
#: Consecutive decisions one probe lasts.
PROBE_LEN = 8


@dataclass
class _Bucket:
    """What one decode batch size measured: tokens/s per mode and the probe schedule."""

    count: tuple[int, int] = (0, 0)
    # per mode (off, on): averages of (tokens, seconds) per step; rate = their ratio
    sums: tuple[tuple[float, float] | None, tuple[float, float] | None] = (None, None)
    best: bool = True
    since_probe: int = 0
    probe_every: int = PROBE_EVERY[0]
    probing: int = 0

    @property
    def rate(self) -> tuple[float | None, float | None]:
        """(off, on) tokens/s: each mode's average tokens over its average seconds."""
        off, on = (None if m is None else m[0] / m[1] for m in self.sums)
        return off, on

    def choose(self) -> bool:
        """This decision's mode (True: draft), advancing the probe schedule."""
        if self.count[1] < WARMUP_SAMPLES:
            return True
        if self.count[0] < MIN_SAMPLES:
            return False
        if self.probing:
            self.probing -= 1
            return not self.best
        self.since_probe += 1
        if self.since_probe >= self.probe_every:
            self.since_probe, self.probing = 0, PROBE_LEN - 1
            return not self.best
        return self.best

    def add(self, drafted: bool, tokens: int, seconds: float) -> bool:
        """Fold in one step (``tokens`` emitted in ``seconds``); True when the better mode
        changed. A mode's rate is the ratio of its averages of tokens and of seconds per
        step, steadier than an average of each step's ratio (a drafting step emits 1 to
        k + 1 tokens per request)."""
        i = int(drafted)
        self.count = (self.count[0] + (i == 0), self.count[1] + (i == 1))
        old, weight = self.sums[i], max(EMA_ALPHA, 1.0 / self.count[i])
        new = (tokens, seconds) if old is None else (
            old[0] + weight * (tokens - old[0]), old[1] + weight * (seconds - old[1]))
        self.sums = (new, self.sums[1]) if i == 0 else (self.sums[0], new)
        off, on = self.rate
        if on is None or off is None or min(self.count) < MIN_SAMPLES:
            return False
        best = on >= off
        if best == self.best:  # a probe confirmed the choice: probe less often
            if not self.probing and drafted != self.best:
                self.probe_every = min(2 * self.probe_every, PROBE_EVERY[1])
            return False
        self.best, self.probe_every, self.since_probe = best, PROBE_EVERY[0], 0
        return True


class SpecGovernor:
    """Turns drafting on or off per decode batch size by the throughput each mode measured.

    A speculative step pays when the tokens it emits (acceptance length per request) outgrow
    what the drafts and the wider verification cost; that depends on the text, the drafter,
    the batch and the machine, so it is measured rather than configured. Each decision
    (made when the proposer runs at the end of a step) is timed from that proposal to the
    end of the next step's execution and credited with the tokens that step emitted:
    ``tokens / (propose_s + execute_s)`` (an EAGLE proposer's catch-up ingest of positions
    stashed while drafting was off is left out: what resuming costs, not what drafting
    does). Per batch size the governor keeps, with drafts and without, long averages of
    tokens and of seconds per step (their ratio is the mode's rate), drafts first
    (``WARMUP_SAMPLES``), then tries plain decoding, then keeps the faster mode and probes
    the other for ``PROBE_LEN`` decisions every ``PROBE_EVERY`` (the interval doubles each
    time a probe confirms the choice). Only pure decode steps whose batch is the decided
    one count. The averages are long (:data:`EMA_ALPHA`) because acceptance comes in
    phases: on W2's random prompts (SmolLM2-135M, shipped head, two drafts, batch 1) a
    round after one that accepted 0, 1 or 2 drafts accepted 0.55, 0.87 and 1.40 on
    average, all worth a drafting step's 1.34x time; a moving average of each step's
    tokens/s over ~5 steps (this governor until the twelfth session) turned drafting off in
    bad phases and came back late, 5 % slower than drafting always there (7.07-7.20 vs
    6.63-6.77 ms a token), where the long averages draft in 95-98 % of the steps and
    match it.
    Output is unchanged either way: verification alone decides what is emitted (greedy
    stays plain decoding's; sampled tokens keep their distribution, though a seeded
    request's exact tokens then depend on when drafting ran, as with the batch-size cap).
    A model drafter keeps ingesting while off, so its cache is whole when drafting resumes.

    Like vLLM's and SGLang's "disable speculation by batch size" but closed-loop: compare
    "dynamic speculation length" in Liu et al. 2024, "Optimizing Speculative Decoding for
    Serving Large Language Models Using Goodput" (SmartSpec), which models the same
    tokens-per-second trade-off.
    """

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._pending: tuple[bool, int, float] | None = None  # (drafted, batch, propose_s)
        self.num_decisions = [0, 0]  # [off, on]

    def decide(self, batch_size: int) -> bool:
        """Whether to draft for the next step, whose decode batch is ``batch_size`` requests."""
        bucket = self._buckets.setdefault(batch_size, _Bucket())
        drafted = bucket.choose()
        self.num_decisions[drafted] += 1
        self._pending = (drafted, batch_size, 0.0)
        return drafted

    def proposed(self, seconds: float) -> None:
        """The proposer of the last decision took ``seconds`` (drafting or ingesting only)."""
        if self._pending is not None:
            self._pending = (*self._pending[:2], seconds)

    def observe(self, num_decodes: int, is_pure_decode: bool, num_tokens: int,
                seconds: float) -> None:
        """The step after the last decision ran: ``num_decodes`` requests decoded,
        ``num_tokens`` emitted in ``seconds`` of execution (without its own proposal)."""
        pending, self._pending = self._pending, None
        if pending is None or not is_pure_decode or num_decodes != pending[1]:
            return
        drafted, batch, propose_s = pending
        total = propose_s + seconds
        if total <= 0 or num_tokens <= 0:
            return
        bucket = self._buckets[batch]
        if bucket.add(drafted, num_tokens, total):
            off, on = bucket.rate
            logger.info("speculative decoding %s at batch %d: %.1f tokens/s with drafts, "
                        "%.1f without", "on" if bucket.best else "off", batch, on, off)

    def rates(self, batch_size: int) -> tuple[float | None, float | None]:
        """(without drafts, with drafts) moving-average tokens/s at ``batch_size``."""
        bucket = self._buckets.get(batch_size)
        return bucket.rate if bucket is not None else (None, None)


def propose_next(engine, sched, hidden, deltas, execute_s: float) -> None:
    """Leave drafts for the next step on ``engine``'s live requests (an
    :class:`~pdserve.engine.llm_engine.LLMEngine` with a proposer): below its batch-size cap,
    and where its :class:`SpecGovernor` (if any) measured that drafting pays; else the
    proposer only ingests the step's tokens.

    Args:
        sched: the step's ``SchedulerOutput``; ``hidden``: its ``StepHidden``.
        deltas: the step's ``RequestDelta`` list (finished requests get no drafts).
        execute_s: seconds the step took up to here.
    """
    cap, num_running = engine.config.spec_disable_batch_size, len(engine.scheduler.running)
    allow = not cap or num_running < cap
    governor = engine.governor
    if governor is not None:
        governor.observe(len(sched.scheduled), sched.num_prefill_tokens == 0,
                         sum(len(d.new_token_ids) for d in deltas), execute_s)
        allow = allow and governor.decide(num_running)
    finished = {d.request_id for d in deltas if d.finished}
    start_s = time.perf_counter()
    engine.proposer.propose(sched, [s.request for s in sched.scheduled
                                    if s.request.request_id not in finished],
                            step_hidden=hidden, allow_drafts=allow)
    if governor is not None:  # a catch-up ingest after drafting was off is not the drafts'
        governor.proposed(time.perf_counter() - start_s
                          - getattr(engine.proposer, "catch_up_s", 0.0))
