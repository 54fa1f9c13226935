"""The router's copy of which prompt prefixes a decode worker holds in its prefix cache.

A decode worker reports every change to its prefix cache (:class:`~pdserve.messages.KVCacheEvents`:
a block's chained hash became cached once its K/V was computed or installed, or left when
the block was evicted), and a full snapshot when it (re)registers; this index applies them.
So a prompt counts as cached on a worker only once the worker has the K/V, never merely
because the router sent it there, and a worker with prefix caching off never looks like it
caches anything. The hashes chain as the engine's
(:func:`~pdserve.engine.block_manager.chain_block_hashes`:
``hash_i = hash((hash_{i-1}, tokens of block i))``), so the router computes a prompt's
hashes itself and counts the leading ones the worker holds. The length-threshold policy
counts only the tokens past that cached prefix, so a follow-up turn of a long conversation
is prefilled on its decode worker.
"""

from __future__ import annotations

from pdserve.engine.block_manager import chain_block_hashes


class PrefixIndex:
    """The set of full-block prefix hashes one decode worker reports as cached.

    Args:
        block_size: the worker's tokens per KV block.

    Raises:
        ValueError: a non-positive block size.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._hashes: set[int] = set()

    def __len__(self) -> int:
        return len(self._hashes)

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        """Tokens of the longest prefix of ``token_ids`` the worker holds (no side effects).

        Like the engine, at least the last token is always left to compute.
        """
        max_blocks = (len(token_ids) - 1) // self.block_size
        num = 0
        for block_hash in chain_block_hashes(token_ids, self.block_size, [])[:max_blocks]:
            if block_hash not in self._hashes:
                break
            num += 1
        return num * self.block_size

    def apply(self, stored: list[bool], block_hashes: list[int], reset: bool = False) -> None:
        """Apply a worker's cache events in order (``stored`` False: evicted); with
        ``reset`` they replace the whole set (a snapshot)."""
        if reset:
            self._hashes.clear()
        for is_stored, block_hash in zip(stored, block_hashes):
            if is_stored:
                self._hashes.add(block_hash)
            else:
                self._hashes.discard(block_hash)
