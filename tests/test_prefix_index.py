"""The router's prefix index: which prompt tokens a decode worker is believed to hold."""

from __future__ import annotations

import pytest

from pdserve.router.prefix_index import PrefixIndex


def test_unknown_prompt_has_nothing_cached():
    assert PrefixIndex(4, 100).num_cached_tokens(list(range(20))) == 0


def test_recorded_prompt_counts_its_full_blocks_but_leaves_one_token_to_compute():
    index = PrefixIndex(4, 100)
    prompt = list(range(10))  # blocks [0..3], [4..7]; 2 tokens in a partial block
    index.record(prompt)
    assert index.num_cached_tokens(prompt) == 8
    assert index.num_cached_tokens(prompt + [99, 98, 97]) == 8
    assert index.num_cached_tokens(list(range(8))) == 4  # the last block must be computed


def test_a_different_earlier_block_breaks_the_chain():
    index = PrefixIndex(4, 100)
    index.record(list(range(12)))
    other = [100, 1, 2, 3] + list(range(4, 12))  # same later blocks, different first one
    assert index.num_cached_tokens(other + [0]) == 0


def test_least_recently_recorded_blocks_are_forgotten_first():
    index = PrefixIndex(2, 3)
    index.record([1, 2, 3, 4])  # 2 blocks
    index.record([9, 9, 8, 8])  # 2 more: capacity 3 drops the oldest ([1, 2])
    assert index.num_cached_tokens([1, 2, 3, 4, 0]) == 0
    assert index.num_cached_tokens([9, 9, 8, 8, 0]) == 4


def test_sizes_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(0, 10)
