"""Gather a request's blocks out of a paged KV cache, and scatter received ones into another.

The cache is the engine's single tensor (see ``ModelRunner.kv_cache``)::

    kv_cache [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]

The sender gathers ``kv_cache[layer_start:layer_end, :, src_block_ids]`` (block-table
order); the receiver writes the same layers into ITS block ids, position by position::

    P: block table [7, 2, 9]  --message (3 blocks)-->  D: block table [0, 5, 1]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.host_memory import empty_host
from pdserve.kvtransfer.wire import DecodedKV


def gather_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                  layer_start: int, layer_end: int) -> torch.Tensor:
    """Copy out layers [layer_start, layer_end) of the given blocks.

    kv_cache: [num_layers, 2, num_blocks, block_size, H, D].
    Returns a new contiguous [layer_end - layer_start, 2, len(block_ids), block_size, H, D].
    """
    _check_cache(kv_cache, layer_start, layer_end)
    ids = _block_index(block_ids, kv_cache.shape[2])
    layers = kv_cache[layer_start:layer_end]
    out = empty_host((layer_end - layer_start, 2, ids.numel(), *kv_cache.shape[3:]),
                     kv_cache.dtype)
    return torch.index_select(layers, 2, ids, out=out)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                   kv: DecodedKV) -> None:
    """Write a verified message into ``kv_cache`` at ``block_ids`` (dequantizing FP8).

    kv_cache: [num_layers, 2, num_blocks, block_size, H, D] bf16/fp16/fp32, written in place.
    block_ids: the receiver's blocks, one per block in the message, in the same order.
    """
    header = kv.header
    _check_cache(kv_cache, header.layer_start, header.layer_end)
    _, _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if (block_size, num_kv_heads, head_dim) != (header.block_size, header.num_kv_heads,
                                                header.head_dim):
        raise ValueError(f"kv: blocks of (block_size, num_kv_heads, head_dim) = "
                         f"{(header.block_size, header.num_kv_heads, header.head_dim)} do "
                         f"not fit a cache of {(block_size, num_kv_heads, head_dim)}")
    ids = _block_index(block_ids, num_cache_blocks)
    if ids.numel() != header.num_blocks:
        raise ValueError(f"block_ids: message has {header.num_blocks} blocks, got "
                         f"{ids.numel()} ids")
    if kv.is_fp8 or kv.values.dtype != kv_cache.dtype:
        values = kv.to_dtype(kv_cache.dtype)  # [L, 2, num_blocks, block_size, H, D]
    else:
        values = kv.values  # aliases the receive buffer; index_copy_ copies it out
    kv_cache[header.layer_start:header.layer_end].index_copy_(2, ids, values)


def _check_cache(kv_cache: torch.Tensor, layer_start: int, layer_end: int) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache: expected [num_layers, 2, num_blocks, block_size, H, D], "
                         f"got {tuple(kv_cache.shape)}")
    if not 0 <= layer_start < layer_end <= kv_cache.shape[0]:
        raise ValueError(f"layers [{layer_start}, {layer_end}) outside the cache's "
                         f"{kv_cache.shape[0]} layers")


def _block_index(block_ids: Sequence[int] | torch.Tensor, num_blocks: int) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.long)
    if ids.dim() != 1:
        raise ValueError(f"block_ids: expected a 1-d list, got shape {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_ids: must be in [0, {num_blocks}), got {ids.tolist()}")
    return ids
