"""Paged KV block allocation with reference counts and prefix caching.

NOTE: the invariant: a block is in ``cached_block_ids`` only once its K/V has been
computed (see :meth:`BlockManager.cache_computed_blocks`), so a prefix-cache hit never
reads uncomputed slots. Free blocks keep their hash and content until they are reused,
so a later request can still hit them (the order of reuse: ``_take_free_block``).

Block hashes chain: ``hash_i = hash((hash_{i-1}, tokens of block i))``, so equal hashes
mean equal whole prefixes, not just equal blocks::

    request A: [ b0 | b1 | b2 | b3 (partial) ]
    request B: [ b0 | b1 | b5 | ... ]          shares b0, b1 (ref_count 2)
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.engine.request import Request

#: Cache events kept before the journal gives up and asks for a snapshot instead (a journal
#: nobody drains, as in the offline engine, stays bounded).
MAX_PENDING_CACHE_EVENTS = 65536

#: Parent hash of a request's first block.
ROOT_HASH = 0


def chain_block_hashes(token_ids: list[int], block_size: int, hashes: list[int]) -> list[int]:
    """Extend ``hashes`` in place over every full block of ``token_ids`` and return it.

    ``hashes`` holds the chained hashes of the first ``len(hashes)`` blocks (start with
    ``[]``); block ``i``'s hash is ``hash((hash of block i - 1, its tokens))`` with
    :data:`ROOT_HASH` before block 0, so equal hashes mean equal whole prefixes. Python
    hashes tuples of ints the same in every process, so the router and the workers agree.
    """
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))))
    return hashes


class Block:
    """One KV block's bookkeeping (the data lives in the KV cache tensors)."""

    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


class BlockManager:
    """Allocates, shares and frees KV blocks.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between requests with equal prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks not findable by a prefix lookup (never written: ahead), cached ones
        self.free_plain_ids = OrderedDict((i, None) for i in reversed(range(num_blocks)))
        self.free_cached_ids: OrderedDict[int, None] = OrderedDict()
        self.cached_block_ids: dict[int, int] = {}
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        #: prefix-cache changes since the last :meth:`drain_cache_events`, in order:
        #: ``(True, hash)`` a block became cached, ``(False, hash)`` it was evicted
        self._cache_events: list[tuple[bool, int]] = []
        self._cache_events_overflowed = False

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no holder, cached ones included (they are evicted on reuse)."""
        return len(self.free_plain_ids) + len(self.free_cached_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by live requests, 0.0 - 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (the last one maybe partly)."""
        return (num_tokens + self.block_size - 1) // self.block_size

    def _update_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over every full block of its tokens."""
        chain_block_hashes(request.token_ids, self.block_size, request.block_hashes)

    def _find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix usable by ``request`` (no side effects).

        At least one token is always left to compute (its logits are needed), so a fully
        cached request recomputes its last block rather than writing into a shared one.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.cached_block_ids.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, request: Request) -> bool:
        """Whether blocks for all of ``request.token_ids`` can be allocated now."""
        hits = self._find_cached_prefix(request)
        num_new = self.num_blocks_for(request.num_tokens) - len(hits)
        num_hits_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return num_new + num_hits_free <= self.num_free_blocks

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``num_new_tokens`` more slots (past the computed ones) fit now."""
        return self._num_missing_blocks(request, num_new_tokens) <= self.num_free_blocks

    def _num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_table))

    # -- actions -------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        """The latest freed block no prefix lookup finds, else a never-written one (CPU pages
        commit on first write: ~8 us a prefilled token of faults), else the LRU cached one."""
        pool = self.free_plain_ids or self.free_cached_ids
        block_id, _ = pool.popitem(last=pool is self.free_plain_ids)
        block = self.blocks[block_id]
        if self.cached_block_ids.get(block.block_hash) == block_id:
            del self.cached_block_ids[block.block_hash]
            self._journal(False, block.block_hash)
        block.block_hash = None
        block.ref_count = 1
        return block_id

    def allocate(self, request: Request) -> None:
        """Give ``request`` blocks for all its tokens, reusing cached prefix blocks.

        Sets ``request.block_table`` and ``request.num_computed_tokens`` (= cached tokens).
        The caller checks :meth:`can_allocate` first.
        """
        assert not request.block_table, "request already holds blocks"
        hits = self._find_cached_prefix(request)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_cached_ids[block_id]
            block.ref_count += 1
        num_new = self.num_blocks_for(request.num_tokens) - len(hits)
        assert num_new <= self.num_free_blocks, "allocate() without can_allocate()"
        request.block_table = hits + [self._take_free_block() for _ in range(num_new)]
        num_cached = len(hits) * self.block_size
        request.num_computed_tokens = num_cached
        if self.enable_prefix_caching:
            self.num_prefix_queried_tokens += request.num_tokens
            self.num_prefix_hit_tokens += num_cached

    def append_slots(self, request: Request, num_new_tokens: int) -> None:
        """Add blocks so ``num_new_tokens`` more tokens fit; caller checks can_append."""
        for _ in range(self._num_missing_blocks(request, num_new_tokens)):
            request.block_table.append(self._take_free_block())

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's trailing blocks past the first ``num_tokens`` slots (rolls back
        slots reserved for speculative tokens that were rejected)."""
        keep = self.num_blocks_for(num_tokens)
        while len(request.block_table) > keep:
            self._release(request.block_table.pop())

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(num_full):
            block = self.blocks[request.block_table[i]]
            if block.block_hash is not None:
                continue
            block_hash = request.block_hashes[i]
            block.block_hash = block_hash
            if block_hash not in self.cached_block_ids:
                self.cached_block_ids[block_hash] = block.block_id
                self._journal(True, block_hash)

    def _journal(self, stored: bool, block_hash: int) -> None:
        if self._cache_events_overflowed:
            return
        self._cache_events.append((stored, block_hash))
        if len(self._cache_events) > MAX_PENDING_CACHE_EVENTS:
            self._cache_events.clear()
            self._cache_events_overflowed = True

    def drain_cache_events(self) -> tuple[bool, list[tuple[bool, int]]]:
        """The prefix cache's changes since the last call, for a router's index of it.

        Returns:
            ``(reset, events)``: with ``reset`` False, ordered ``(stored, block_hash)``
            changes (``stored`` False: evicted); with ``reset`` True (the journal overflowed,
            or :meth:`request_cache_snapshot` was called), ``events`` lists every cached
            block as stored and replaces what the reader knew.
        """
        if self._cache_events_overflowed:
            self._cache_events_overflowed = False
            self._cache_events.clear()
            return True, [(True, h) for h in self.cached_block_ids]
        events, self._cache_events = self._cache_events, []
        return False, events

    def request_cache_snapshot(self) -> None:
        """Make the next :meth:`drain_cache_events` a full snapshot (a new reader)."""
        self._cache_events_overflowed = True

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first: of cached ones, evicted first)."""
        for block_id in reversed(request.block_table):
            self._release(block_id)
        request.block_table = []

    def _release(self, block_id: int) -> None:
        """Drop one holder of the block; with none left it joins a free pool's tail."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, "block freed twice"
        if block.ref_count == 0:
            cached = self.cached_block_ids.get(block.block_hash) == block_id
            (self.free_cached_ids if cached else self.free_plain_ids)[block_id] = None
