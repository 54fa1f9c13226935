"""The router's estimate of which prompt prefixes a decode worker holds in its prefix cache.

The router remembers, per decode worker, the chained block hashes of the prompts it sent
there (the same chaining as the engine's :class:`~pdserve.engine.block_manager.BlockManager`:
``hash_i = hash((hash_{i-1}, tokens of block i))``), in LRU order, up to the worker's
number of KV blocks. It is an estimate: the worker may have evicted a block the router
still lists (then the worker simply prefills more itself), never the reverse of a block it
never saw. The length-threshold policy counts only the tokens past the estimated cached
prefix, so a follow-up turn of a long conversation is prefilled on its decode worker.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.engine.block_manager import chain_block_hashes



class PrefixIndex:
    """LRU set of full-block prefix hashes of one decode worker.

    Args:
        block_size: the worker's tokens per KV block.
        capacity_blocks: most hashes remembered (the worker's KV block count).

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be positive")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def _block_hashes(self, token_ids: list[int]) -> list[int]:
        return chain_block_hashes(token_ids, self.block_size, [])

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        """Tokens of the longest prefix of ``token_ids`` believed cached (no side effects).

        Like the engine, at least the last token is always left to compute.
        """
        max_blocks = (len(token_ids) - 1) // self.block_size
        num = 0
        for block_hash in self._block_hashes(token_ids)[:max_blocks]:
            if block_hash not in self._hashes:
                break
            num += 1
        return num * self.block_size

    def record(self, token_ids: list[int]) -> None:
        """Note that the worker now holds ``token_ids``' full blocks (most recent use)."""
        for block_hash in self._block_hashes(token_ids):
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity_blocks:
            self._hashes.popitem(last=False)
