"""The router's prefix index (what a decode worker reports as cached) and the block
manager's cache-event journal that feeds it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.block_manager import MAX_PENDING_CACHE_EVENTS, BlockManager, chain_block_hashes
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.prefix_index import PrefixIndex


def stored(index: PrefixIndex, token_ids: list[int], is_stored: bool = True) -> None:
    hashes = chain_block_hashes(token_ids, index.block_size, [])
    index.apply([is_stored] * len(hashes), hashes)


def test_unknown_prompt_has_nothing_cached():
    assert PrefixIndex(4).num_cached_tokens(list(range(20))) == 0


def test_reported_prompt_counts_its_full_blocks_but_leaves_one_token_to_compute():
    index = PrefixIndex(4)
    prompt = list(range(10))  # blocks [0..3], [4..7]; 2 tokens in a partial block
    stored(index, prompt)
    assert index.num_cached_tokens(prompt) == 8
    assert index.num_cached_tokens(prompt + [99, 98, 97]) == 8
    assert index.num_cached_tokens(list(range(8))) == 4  # the last block must be computed


def test_a_different_earlier_block_breaks_the_chain():
    index = PrefixIndex(4)
    stored(index, list(range(12)))
    other = [100, 1, 2, 3] + list(range(4, 12))  # same later blocks, different first one
    assert index.num_cached_tokens(other + [0]) == 0


def test_events_apply_in_order_and_a_snapshot_replaces_the_set():
    index = PrefixIndex(2)
    h = chain_block_hashes([1, 2, 3, 4], 2, [])
    index.apply([True, True, False, True], [h[0], h[1], h[0], h[0]])  # evicted, cached again
    assert index.num_cached_tokens([1, 2, 3, 4, 0]) == 4
    index.apply([False], [h[0]])  # the first block gone: nothing after it counts
    assert index.num_cached_tokens([1, 2, 3, 4, 0]) == 0 and len(index) == 1
    index.apply([True], [h[0]], reset=True)
    assert len(index) == 1 and index.num_cached_tokens([1, 2, 3, 4, 0]) == 2


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(0)


def _computed(bm: BlockManager, rid: str, token_ids: list[int]) -> Request:
    req = Request(rid, token_ids, SamplingParams(), max_tokens=8, eos_token_ids=(),
                  device=torch.device("cpu"))
    bm.allocate(req)
    req.num_computed_tokens = len(token_ids)
    bm.cache_computed_blocks(req)
    return req


def test_block_manager_journals_cached_and_evicted_blocks_for_the_router():
    """What the decode worker sends (KVCacheEvents) replays into the router's index as the
    worker's own cache: blocks count once computed, stop counting once evicted."""
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    index = PrefixIndex(2)
    a = _computed(bm, "a", [1, 2, 3, 4, 5])  # 2 full blocks cached, 1 partial
    reset, events = bm.drain_cache_events()
    assert not reset and [s for s, _ in events] == [True, True]
    index.apply([s for s, _ in events], [h for _, h in events])
    assert index.num_cached_tokens([1, 2, 3, 4, 9]) == 4
    assert bm.drain_cache_events() == (False, [])
    bm.free(a)  # freed blocks keep their K/V: still cached, no event
    assert bm.drain_cache_events() == (False, [])
    _computed(bm, "b", [7, 7, 8, 8, 9, 9, 6])  # needs all 4 blocks: evicts a's two
    reset, events = bm.drain_cache_events()
    index.apply([s for s, _ in events], [h for _, h in events])
    assert index.num_cached_tokens([1, 2, 3, 4, 9]) == 0
    assert index.num_cached_tokens([7, 7, 8, 8, 9, 9, 0]) == 6
    assert len(index) == len(bm.cached_block_ids) == 3


def test_block_manager_journal_stays_bounded_and_snapshots_when_asked():
    bm = BlockManager(num_blocks=2, block_size=1, enable_prefix_caching=True)
    for i in range(MAX_PENDING_CACHE_EVENTS // 2 + 2):  # each request: 1 stored + 1 evicted
        bm.free(_computed(bm, str(i), [i, i + 1]))
    reset, events = bm.drain_cache_events()  # nobody drained: a snapshot instead
    assert reset and sorted(h for _, h in events) == sorted(bm.cached_block_ids)
    bm.request_cache_snapshot()
    reset, events = bm.drain_cache_events()
    assert reset and len(events) == len(bm.cached_block_ids)
    off = BlockManager(num_blocks=2, block_size=1, enable_prefix_caching=False)
    _computed(off, "x", [1, 2])
    assert off.drain_cache_events() == (False, [])  # no prefix caching: nothing is cached


def test_block_manager_reuses_written_blocks_before_fresh_ones_and_evicts_cached_last():
    """Reuse order: freed blocks no prefix lookup can find (most recently freed first),
    then never-written blocks (their pages not yet committed), then cached blocks, least
    recently freed first; a cached prefix survives while fresh blocks remain."""
    off = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = _computed(off, "a", [1, 2, 3, 4, 5])
    assert a.block_table == [0, 1, 2]
    off.free(a)
    b = _computed(off, "b", [6, 7, 8, 9])  # the blocks just written, not fresh ones 3, 4
    assert sorted(b.block_table) == [0, 1] and off.num_free_blocks == 6
    c = _computed(off, "c", [1] * 9)  # a's last block (still free), then fresh ones
    assert c.block_table == [2, 3, 4, 5, 6]
    assert off.num_free_blocks == 1 and off.can_allocate(_request([1, 2])) is True

    on = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = _computed(on, "a", [1, 2, 3, 4, 5])  # blocks 0, 1 cached, 2 partial
    on.free(a)
    b = _computed(on, "b", [7, 7, 8, 8, 9])  # reuses the partial block 2, then fresh 3, 4
    assert b.block_table == [2, 3, 4]
    hit = _computed(on, "hit", [1, 2, 3, 4, 6])  # a's cached prefix kept, fresh block 5
    assert hit.block_table == [0, 1, 5] and on.num_prefix_hit_tokens == 4
    on.free(b)
    on.free(hit)  # partial blocks 4, 5 plain; 3, 2, then 1, 0 cached in that order
    d = _computed(on, "d", [5, 5, 6, 6, 7, 7, 8])  # the plain ones, then b's cached 3, 2
    assert d.block_table == [5, 4, 3, 2] and on.num_free_blocks == 2
    h = chain_block_hashes([1, 2, 3, 4], 2, [])  # a's prefix outlived b's
    assert [on.cached_block_ids.get(x) for x in h] == [0, 1]
    assert not on.can_allocate(_request([1, 2, 3, 4, 0]))  # 3 blocks: only 0, 1 are free


def _request(token_ids: list[int]) -> Request:
    return Request("r", token_ids, SamplingParams(), max_tokens=8, eos_token_ids=(),
                   device=torch.device("cpu"))
