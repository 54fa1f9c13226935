"""Specification tests for prompt-lookup drafting (pdserve.engine.spec_decode.ngram)."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.proposer import TokenProposer


def propose_one(token_ids: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    return NgramProposer(min_n=min_n, max_n=max_n).propose([token_ids], k)[0]


def reference_proposal(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force straight from the definition: longest n first, then latest occurrence."""
    length = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = token_ids[length - n :]
        for start in range(length - n - 1, -1, -1):  # occurrence must end before the suffix
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []


def test_longest_suffix_ngram_is_preferred_over_a_more_recent_shorter_match():
    # "1 2" matches at 0..1 (followed by 3); only "2" matches at 4 (followed by 5).
    assert propose_one([1, 2, 3, 9, 2, 5, 1, 2], k=1) == [3]


def test_max_n_limits_the_match_length():
    # With max_n = 1 only the last token is matched, so the latest "2" (followed by 5) wins.
    assert propose_one([1, 2, 3, 9, 2, 5, 1, 2], k=1, max_n=1) == [5]


def test_most_recent_occurrence_of_the_longest_ngram_is_used():
    assert propose_one([1, 2, 7, 1, 2, 8, 1, 2], k=1, max_n=2) == [8]


def test_no_match_gives_an_empty_proposal():
    assert propose_one([1, 2, 3, 4], k=3) == []


def test_matches_shorter_than_min_n_are_ignored():
    assert propose_one([4, 1, 7, 5, 1], k=2, min_n=2) == []


def test_k_caps_the_proposal_length():
    assert propose_one([1, 2, 3, 4, 5, 6, 9, 1, 2], k=2) == [3, 4]


def test_proposal_stops_at_the_end_of_the_history():
    # "5 6" at 0..1 is followed by only two tokens before the history ends.
    assert propose_one([5, 6, 5, 6], k=5) == [5, 6]


def test_overlapping_occurrence_of_a_repeated_token():
    # Suffix "1 1" (max possible n = 2) last occurs ending at index 1, followed by one token.
    assert propose_one([1, 1, 1], k=5) == [1]


def test_short_histories_and_k_zero_give_empty_proposals():
    proposer = NgramProposer()
    assert proposer.propose([[], [3], [3, 3]], 2) == [[], [], [3]]
    assert proposer.propose([[1, 2, 1]], 0) == [[]]


def test_requests_in_a_batch_are_independent():
    batch = [[1, 2, 3, 1, 2], [4, 5, 6], [7, 8, 7]]
    assert NgramProposer().propose(batch, 3) == [[3, 1, 2], [], [8, 7]]


def test_matches_brute_force_definition_on_random_histories():
    rng = random.Random(0)
    proposer = NgramProposer(min_n=2, max_n=3)
    for _ in range(300):
        history = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        k = rng.randrange(0, 5)
        assert proposer.propose([history], k)[0] == reference_proposal(history, k, 2, 3), history


@pytest.mark.parametrize(
    ("min_n", "max_n", "field"), [(0, 4, "min_n"), (3, 2, "max_n")]
)
def test_invalid_configuration_names_the_field(min_n: int, max_n: int, field: str):
    with pytest.raises(ValueError, match=field):
        NgramProposer(min_n=min_n, max_n=max_n)


def test_negative_k_is_rejected():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer().propose([[1, 1]], -1)


def test_ngram_proposer_is_a_token_proposer():
    assert isinstance(NgramProposer(), TokenProposer)
