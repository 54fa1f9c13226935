"""Triton attention backend (GPU; CPU only under ``TRITON_INTERPRET=1``, for tests).

Per layer and step: the KV store kernel writes the new K/V (fused FP8 quantization for an
FP8 cache), then the leading decodes run the paged decode kernel and the prefills the varlen
prefill kernel, both reading their whole context from the paged cache::

    batch rows:  | decodes (1 token each) | prefill 0 | prefill 1 | ... |
    kernels:       paged_decode_attention   paged_prefill_attention (one launch)

Metadata is tensors only (block tables, lengths, offsets, store segments), built once per
step on the host and copied to the device in one go; nothing in :meth:`forward` reads a
device value on the host, so a decode-only step can be captured in a CUDA graph
(:mod:`pdserve.engine.compiled.cuda_graphs`) with static buffers behind these tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import AttentionInputs, register_backend
from pdserve.engine.kernels import is_interpreted
from pdserve.engine.kernels.decode_attention import _decode_kernel, paged_decode_attention
from pdserve.engine.kernels.kv_store import store_kv, store_segments
from pdserve.engine.kernels.prefill_attention import paged_prefill_attention


@dataclass
class TritonAttentionMetadata:
    """Per-step metadata, shared by every layer (all tensors on the engine's device).

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 write slots (``PAD_SLOT_ID`` = skip).
        segments: ``(token_starts, num_tokens)`` ``[num_segments]`` int32 each: runs of
            batch tokens in one block, for the FP8 store.
        num_decodes: leading decode requests (one token each).
        decode_block_tables: ``[num_decodes, max_blocks]`` int32.
        decode_seq_lens: ``[num_decodes]`` int32 (0 = padding row).
        prefill_block_tables: ``[num_prefills, max_blocks]`` int32.
        prefill_cu_query_lens: ``[num_prefills + 1]`` int32 row offsets into the batch.
        prefill_seq_lens: ``[num_prefills]`` int32.
        max_prefill_query_len: longest prefill chunk this step (0 without prefills).
    """

    slot_mapping: torch.Tensor
    segments: tuple[torch.Tensor, torch.Tensor]
    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_cu_query_lens: torch.Tensor
    prefill_seq_lens: torch.Tensor
    max_prefill_query_len: int


def block_table_tensor(block_tables: list[list[int]], seq_lens: list[int], block_size: int,
                       num_cols: int | None = None) -> torch.Tensor:
    """``[num_reqs, num_cols]`` int32 host tensor of the blocks each context uses (0-padded).

    ``num_cols`` defaults to the most blocks any request needs.
    """
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    cols = max(need, default=0) if num_cols is None else num_cols
    table = torch.zeros((len(block_tables), max(cols, 1)), dtype=torch.int32)
    for i, (bt, n) in enumerate(zip(block_tables, need)):
        if n:
            table[i, :n] = torch.tensor(bt[:n], dtype=torch.int32)
    return table


class TritonAttentionBackend:
    """See the module docstring.

    Raises:
        ValueError: on a CPU device unless the kernels were built for Triton's interpreter.
    """

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and not is_interpreted(_decode_kernel):
            raise ValueError("attention_backend 'triton' needs a CUDA device (or "
                             "TRITON_INTERPRET=1 set before import, for tests on CPU)")
        self.device = device

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        """Block tables, lengths and row offsets as host tensors, copied to the device in one
        go; see :meth:`AttentionBackend.build_metadata`."""
        nd, bs, dev = inputs.num_decodes, inputs.block_size, self.device
        decode_tables = block_table_tensor(inputs.block_tables[:nd], inputs.seq_lens[:nd], bs)
        prefill_tables = block_table_tensor(inputs.block_tables[nd:], inputs.seq_lens[nd:], bs)
        prefill_q = inputs.query_lens[nd:]
        cu = list(itertools.accumulate(prefill_q, initial=nd))
        host = dict(
            decode_block_tables=decode_tables,
            decode_seq_lens=torch.tensor(inputs.seq_lens[:nd], dtype=torch.int32),
            prefill_block_tables=prefill_tables,
            prefill_cu_query_lens=torch.tensor(cu, dtype=torch.int32),
            prefill_seq_lens=torch.tensor(inputs.seq_lens[nd:], dtype=torch.int32),
        )
        on_device = {k: t.to(dev, non_blocking=True) for k, t in host.items()}
        return TritonAttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            segments=store_segments(inputs.query_lens, inputs.seq_lens, bs, dev),
            num_decodes=nd, max_prefill_query_len=max(prefill_q, default=0), **on_device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`: the KV store kernel, then the paged decode
        kernel over the leading decodes and the varlen prefill kernel over the rest."""
        k_scales, v_scales = kv_scales if kv_scales is not None else (None, None)
        store_kv(k, k_cache, metadata.slot_mapping, k_scales, metadata.segments)
        store_kv(v, v_cache, metadata.slot_mapping, v_scales, metadata.segments)
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            paged_decode_attention(q[:nd], k_cache, v_cache, metadata.decode_block_tables,
                                   metadata.decode_seq_lens, scale, k_scales, v_scales,
                                   out=out[:nd])
        if metadata.max_prefill_query_len:
            paged_prefill_attention(q, k_cache, v_cache, metadata.prefill_block_tables,
                                    metadata.prefill_cu_query_lens, metadata.prefill_seq_lens,
                                    metadata.max_prefill_query_len, scale, k_scales, v_scales,
                                    out=out)
        return out


register_backend("triton", TritonAttentionBackend)
