"""Counters of speculative decoding: drafts, draft tokens, accepted tokens per position."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

#: Seconds between two acceptance-length log lines.
LOG_INTERVAL_S = 10.0


class SpecDecodeStats:
    """Cumulative acceptance counters of one engine (the workers report them as metrics).

    Acceptance length = accepted draft tokens + 1 (the correction or bonus token) per
    verification; its mean is ``1 + num_accepted_tokens / num_drafts``.

    Args:
        num_speculative_tokens: k, the number of draft positions tracked.
    """

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens
        self._last_log_s = time.monotonic()
        self._logged = (0, 0)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one verification of ``num_draft_tokens`` drafts, a prefix of which passed."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(min(num_accepted_tokens, len(self.num_accepted_tokens_per_pos))):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """``1 + accepted / drafts`` over all verifications so far; None before the first."""
        if self.num_drafts == 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    def maybe_log(self) -> None:
        """Log the mean acceptance length of the last interval, at most every LOG_INTERVAL_S."""
        now = time.monotonic()
        if now - self._last_log_s < LOG_INTERVAL_S:
            return
        drafts = self.num_drafts - self._logged[0]
        accepted = self.num_accepted_tokens - self._logged[1]
        self._last_log_s = now
        if drafts:
            self._logged = (self.num_drafts, self.num_accepted_tokens)
            logger.info("speculative decoding: mean acceptance length %.2f over %d drafts "
                        "(per position: %s)", 1.0 + accepted / drafts, drafts,
                        self.num_accepted_tokens_per_pos)
