"""Prompt-lookup (n-gram) drafting: copy what followed the last time the context's tail appeared.

For each request the token history (prompt + output) is searched for an earlier occurrence
of its own suffix n-gram; the tokens that followed that occurrence become the draft::

    history:  a b c d x y a b c   (suffix "a b c", n = 3)
              └─┬─┘ └─┬─┘
             match   proposal (k = 2) -> [d, x]

The longest suffix n-gram (``max_n`` down to ``min_n``) with an earlier occurrence wins; among
occurrences of that length the most recent one is used. Drafts are copied tokens, i.e. point
masses: verify them with ``draft_probs=None`` in the rejection sampler.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to ``k`` tokens per request by n-gram lookup in its own history.

    Complexity per request with history length ``L``: one vectorized ``O(L)`` comparison for
    the last token, then at most ``max_n - 1`` further filters over the *surviving* candidate
    positions only, so ``O(L + max_n * C)`` with ``C <= L`` the number of positions whose
    token equals the last one; ``O(L)`` memory. Everything is numpy, no Python loop over
    tokens.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if min_n < 1:
            raise ValueError(f"min_n must be at least 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n must be >= min_n ({min_n}), got {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(
        self, requests_token_ids: list[list[int]], num_speculative_tokens: int
    ) -> list[list[int]]:
        """Drafts for a batch of requests.

        Args:
            requests_token_ids: each request's full history, prompt followed by output.
            num_speculative_tokens: k, the most tokens proposed per request (>= 0).

        Returns:
            Per request a list of 0 .. k token ids (empty when no n-gram matches).

        Raises:
            ValueError: ``num_speculative_tokens`` is negative.
        """
        if num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}"
            )
        return [self._propose_one(ids, num_speculative_tokens) for ids in requests_token_ids]

    def _propose_one(self, token_ids: list[int], num_speculative_tokens: int) -> list[int]:
        match_end = self.find_match_end(np.asarray(token_ids, dtype=np.int64))
        if match_end is None or num_speculative_tokens == 0:
            return []
        return token_ids[match_end + 1 : match_end + 1 + num_speculative_tokens]

    def find_match_end(self, token_ids: np.ndarray) -> int | None:
        """Index of the last token of the chosen earlier occurrence, or ``None``.

        Args:
            token_ids: ``[L]`` int64 history.

        Returns:
            ``e < L - 1`` such that ``token_ids[e - n + 1 : e + 1]`` equals the length-``n``
            suffix for the largest ``n`` in ``[min_n, max_n]`` that has an occurrence, and the
            largest such ``e``; ``None`` when no ``n >= min_n`` matches.
        """
        num_tokens = token_ids.shape[0]
        if num_tokens < 2:
            return None
        # Candidate end positions e in [0, L - 2]; after step i every survivor satisfies
        # token_ids[e - j] == token_ids[L - 1 - j] for all j <= i, i.e. matches n = i + 1.
        candidates = np.flatnonzero(token_ids[:-1] == token_ids[-1])  # [C] int64, ascending
        best_end = None
        for i in range(self.max_n):
            if candidates.size == 0:
                break
            if i > 0:
                candidates = candidates[candidates >= i]
                candidates = candidates[token_ids[candidates - i] == token_ids[num_tokens - 1 - i]]
                if candidates.size == 0:
                    break
            if i + 1 >= self.min_n:
                best_end = int(candidates[-1])  # most recent occurrence of the longest n so far
        return best_end
