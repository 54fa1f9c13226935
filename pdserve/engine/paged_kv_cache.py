"""The paged KV cache: every layer's K and V blocks in one tensor, sized from a memory budget,
plus whole-block copies in and out for remote prefill.

Layout (an FP8 cache adds one fp32 scale per layer, K/V, block and KV head, the KV wire
format's; see :mod:`pdserve.fp8`)::

    cache   [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
    scales  [num_layers, 2 (K, V), num_blocks, num_kv_heads] fp32      (FP8 only)
"""

from __future__ import annotations

import math
import mmap
import os

import torch

from pdserve.engine.config import (DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_GPU_KV_CACHE_FRACTION,
                                   EngineConfig, ModelArchConfig)


def _zeros_committed_on_touch(shape: tuple[int, ...], dtype: torch.dtype,
                              device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype)``; on CPU an anonymous ``mmap`` (4 KB pages committed on
    first write: resident memory grows with the blocks in use). NumPy's huge-page advice made
    first writes compact memory (THP defrag "madvise"): 512 MB in 0.70 s vs 0.13 s here."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _num_blocks(config: EngineConfig, arch: ModelArchConfig, cache_dtype: torch.dtype,
                device: torch.device) -> int:
    """Blocks the configured budget holds (``num_kv_blocks``, else a byte budget: given,
    a fraction of free memory, or the device's default)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    bytes_per_block = arch.kv_bytes_per_token(cache_dtype) * config.block_size
    if cache_dtype == torch.float8_e4m3fn:  # + one fp32 scale per layer, K/V, head
        bytes_per_block += 2 * arch.num_layers * arch.num_kv_heads * 4
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif config.kv_cache_memory_fraction is not None:
        budget = int(_available_memory_bytes(device) * config.kv_cache_memory_fraction)
    elif device.type == "cuda":
        budget = int(_available_memory_bytes(device) * DEFAULT_GPU_KV_CACHE_FRACTION)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    return max(1, budget // bytes_per_block)


class PagedKVCache:
    """The KV cache of one engine (see the module docstring for the layout).

    Args:
        config: sizes the cache (block size, KV budget, ``kv_cache_dtype``) and places it.
        arch: the model's layers and KV heads.
        dtype: the compute dtype (the cache's dtype unless FP8; what reads return).
        max_model_len: one sequence this long must fit.

    Raises:
        ValueError: when the budget cannot hold one ``max_model_len`` sequence.
    """

    def __init__(self, config: EngineConfig, arch: ModelArchConfig, dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.device = config.torch_device
        self.dtype = dtype
        self.block_size = config.block_size
        cache_dtype = config.resolve_kv_cache_dtype(dtype)
        self.num_blocks = _num_blocks(config, arch, cache_dtype, self.device)
        if self.num_blocks * self.block_size < max_model_len:
            raise ValueError(
                f"KV cache budget ({self.num_blocks} blocks of {self.block_size} tokens) cannot "
                f"hold one sequence of max_model_len={max_model_len}; raise the KV budget "
                "(num_kv_blocks / kv_cache_memory_bytes / kv_cache_memory_fraction) or lower "
                "max_model_len"
            )
        self.cache = _zeros_committed_on_touch(
            (arch.num_layers, 2, self.num_blocks, self.block_size, arch.num_kv_heads,
             arch.head_dim), cache_dtype, self.device)
        self.scales: torch.Tensor | None = None
        if cache_dtype == torch.float8_e4m3fn:
            self.scales = torch.ones((arch.num_layers, 2, self.num_blocks, arch.num_kv_heads),
                                     dtype=torch.float32, device=self.device)
        #: per layer, as the model takes it: ``(k_cache, v_cache)``, plus ``(k_scales,
        #: v_scales)`` for an FP8 cache
        self.layers = [self._layer(i) for i in range(arch.num_layers)]
        self.num_bytes = self.cache.numel() * self.cache.element_size() + (
            0 if self.scales is None else self.scales.numel() * 4)

    def _layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        caches = (self.cache[layer, 0], self.cache[layer, 1])
        if self.scales is None:
            return caches
        return caches + (self.scales[layer, 0], self.scales[layer, 1])

    def read_blocks(self, block_ids: list[int], layer: int | None = None) -> torch.Tensor:
        """Copy of some blocks, all layers (or only ``layer``), in the compute dtype (FP8
        codes dequantized).

        Returns:
            ``[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]``
            (``num_layers`` = 1 with ``layer``).
        """
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        if self.scales is None:
            return self.cache[layers].index_select(2, ids)
        codes, scales = self.read_fp8_blocks(block_ids, layer)
        return (codes.to(torch.float32) * scales[:, :, :, None, :, None]).to(self.dtype)

    def read_fp8_blocks(self, block_ids: list[int], layer: int | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 cache's blocks as they are, ready for the wire without re-quantizing.

        Returns:
            ``(codes, scales)``: ``[num_layers, 2, n, block_size, H, D]`` float8_e4m3fn and
            ``[num_layers, 2, n, H]`` fp32 (the wire format's layout); ``num_layers`` = 1
            with ``layer``.

        Raises:
            ValueError: the cache is not FP8.
        """
        if self.scales is None:
            raise ValueError("read_fp8_kv_blocks needs kv_cache_dtype='fp8'")
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        codes = self.cache[layers].view(torch.uint8).index_select(2, ids).view(self.cache.dtype)
        return codes, self.scales[layers].index_select(2, ids)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor, num_tokens: int,
                     scales: torch.Tensor | None = None) -> None:
        """Store received blocks (e.g. a remote prefill's) into this cache.

        Args:
            block_ids: destination blocks, in order.
            kv: ``[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]``, any
                float dtype, any device; or float8_e4m3fn codes with their ``scales``.
            num_tokens: valid tokens in ``kv`` (the last block may be partial). An FP8 cache
                quantizes ``kv`` as the wire format does (one scale per layer, K/V, block, KV
                head), after zeroing the positions past ``num_tokens`` so stale values do not
                widen the last block's scale; FP8 codes and scales are stored as they are.
            scales: ``[num_layers, 2, len(block_ids), num_kv_heads]`` fp32 with FP8 ``kv``:
                stored as they are in an FP8 cache, dequantized into any other (fused with
                the scatter on CPU: :func:`pdserve.fp8.dequantize_into_cache`).

        Raises:
            ValueError: FP8 ``kv`` without scales.
        """
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        if (kv.dtype == torch.float8_e4m3fn) != (scales is not None):
            raise ValueError("scales: give them exactly with float8_e4m3fn kv")
        if scales is not None and self.scales is None:  # the FP8 wire into a 16/32-bit cache
            from pdserve.fp8 import dequantize_blocks, dequantize_into_cache  # noqa: PLC0415

            if self.cache.device.type == "cpu":  # one pass: dequantize + scatter
                dequantize_into_cache(kv, scales, self.cache, ids, layer_start=0)
            else:
                self.cache[:, :, ids] = dequantize_blocks(
                    kv.cpu(), scales.cpu(), self.cache.dtype).to(self.device)
            return
        if scales is not None:
            self.cache.view(torch.uint8)[:, :, ids] = kv.view(torch.uint8).to(self.device)
            self.scales[:, :, ids] = scales.to(self.device)
            return
        if self.scales is None:
            self.cache[:, :, ids] = kv.to(device=self.device, dtype=self.cache.dtype)
            return
        from pdserve.fp8 import quantize_blocks  # noqa: PLC0415

        kv = kv.to(device="cpu", dtype=torch.float32).clone()
        kv.view(*kv.shape[:2], -1, *kv.shape[4:])[:, :, num_tokens:] = 0
        payload, scales = quantize_blocks(kv)
        self.cache.view(torch.uint8)[:, :, ids] = payload.view(torch.uint8).to(self.device)
        self.scales[:, :, ids] = scales.to(self.device)
