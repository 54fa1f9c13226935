"""Reference attention backend in plain torch (CPU and CUDA).

Decodes are batched: each decode's context is gathered from the paged cache into a padded
``[num_decodes, max_seq_len]`` layout and attended with one SDPA call, grouping the query
heads that share a KV head so K/V are never repeated. Prefills run one SDPA call per
request, over the request's own fresh K/V when it has no earlier context, else over its
context gathered from the cache with a causal mask offset by the context length.

Paged cache layout (per layer, K and V alike)::

    k_cache[num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_table[pos // block_size] * block_size + pos % block_size

An FP8 cache (``kv_scales`` given) is written by the KV store's torch reference
(:func:`~pdserve.engine.kernels.kv_store.store_kv_reference`) and its gathered context is
dequantized (codes times their block's scale) before attention. A prefill without earlier
context attends over its own fresh K/V at full precision (the FP8 cache serves later steps);
the Triton backend reads them back from the cache instead, a difference of one FP8 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.attention.base import AttentionInputs, register_backend
from pdserve.engine.kernels.chunk_attention import context_then_causal
from pdserve.engine.kernels.cpu_prefill_attention import prefill_attention, takes_prefill
from pdserve.engine.kernels.kv_store import store_kv_reference
from pdserve.engine.layers.linear import cpu_has_native_gemm


@dataclass
class PrefillSeq:
    """One prefilling request inside the flattened batch.

    Attributes:
        query_start: index of its first query token in the batch.
        query_len: its new tokens this step.
        context_slots: ``[seq_len]`` int64 cache slots of its whole context, or None when
            the context is exactly the new tokens (attend to the fresh K/V, plain causal).
        mask: ``[query_len, seq_len]`` bool (True = attend), or None with ``context_slots``.
    """

    query_start: int
    query_len: int
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Decodes whose contexts are attended together, padded to the group's longest.

    Attributes:
        rows: ``[n]`` int64 batch rows of the group's decodes, or None when the group is
            every decode of the step in order (rows ``0 .. num_decodes - 1``).
        slots: ``[n, max_seq_len]`` int64 gather slots (padding gathers slot 0 and is
            masked out).
        mask: ``[n, 1, 1, max_seq_len]`` bool, True = attend; None when every decode of the
            group attends to all ``max_seq_len`` slots (always for one decode).
    """

    rows: torch.Tensor | None
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata:
    """Per-step metadata, shared by every layer.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 write slots.
        num_decodes: leading decode requests (one token each).
        decode_groups: the decodes by context length (see :func:`_decode_groups`).
        prefills: the prefilling requests, in batch order.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]


def _decode_groups(seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                   device: torch.device) -> list[DecodeGroup]:
    """Decodes grouped so that padding stays bounded: one group while the longest context
    is at most twice the shortest (the common case: one SDPA call for the batch), else one
    group per power-of-two length class. Padding every decode to the batch's longest made
    one 3,000-token request turn 20 decodes over 200 tokens into 20 over 3,000 (measured:
    decode steps of seconds under mixed load)."""
    if max(seq_lens) <= 2 * min(seq_lens):
        classes = {0: list(range(len(seq_lens)))}
    else:
        classes = {}
        for i, n in enumerate(seq_lens):
            classes.setdefault((n - 1).bit_length(), []).append(i)
    groups = []
    for members in classes.values():
        lens = [seq_lens[i] for i in members]
        max_len = max(lens)
        max_blocks = (max_len + block_size - 1) // block_size
        table = torch.zeros((len(members), max_blocks), dtype=torch.int64)
        for j, i in enumerate(members):
            bt = block_tables[i][:max_blocks]
            table[j, :len(bt)] = torch.tensor(bt, dtype=torch.int64)
        pos = torch.arange(max_len, dtype=torch.int64)
        slots = table[:, pos // block_size] * block_size + pos % block_size  # [n, max_len]
        valid = pos[None, :] < torch.tensor(lens, dtype=torch.int64)[:, None]
        rows = (None if len(members) == len(seq_lens)
                else torch.tensor(members, dtype=torch.int64, device=device))
        groups.append(DecodeGroup(
            rows, torch.where(valid, slots, 0).to(device),
            None if min(lens) == max_len else valid[:, None, None, :].to(device)))
    return groups


#: Largest query length with cached context that runs as rows per KV head (see forward).
_ROWS_MAX_QUERY = 64


def _rows_per_kv_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Masked GQA attention with the query heads of a KV head as rows of one attention.

    ``q [n, H, D]``, ``k``/``v [Hkv, L, D]``, ``mask [n, L]`` bool -> ``[n, H, D]``. As for
    decodes, no K/V repeat: measured on 2 cores, 3.5x faster than ``enable_gqa`` for 4 query
    rows over 1,000 cached tokens (speculative verification), 1.3x slower for 256 rows (a
    prefill chunk), hence :data:`_ROWS_MAX_QUERY`.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    rows = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    # 4-D operands: torch's CPU flash kernel takes only those (3-D goes to the math path).
    out = F.scaled_dot_product_attention(
        rows.reshape(1, num_kv_heads, group * n, head_dim), k[None], v[None],
        attn_mask=mask.repeat(group, 1), scale=scale)
    return out.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(
        n, num_heads, head_dim)


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """``[num_slots, num_kv_heads, head_dim]`` rows of ``cache`` at ``slots``, in ``dtype``.

    ``cache`` is ``[num_blocks, block_size, H, D]``; with ``scales`` (``[num_blocks, H]``
    fp32) it holds FP8 codes, returned times their block's scale.
    """
    flat = cache.view(-1, *cache.shape[2:])
    if scales is None:
        # index_select on the flat cache: ~6x faster than advanced indexing on CPU.
        return flat.index_select(0, slots).to(dtype)
    codes = flat.view(torch.uint8).index_select(0, slots).view(cache.dtype)
    block_scales = scales.index_select(0, slots // cache.shape[1])  # [num_slots, H]
    return (codes.to(torch.float32) * block_scales[:, :, None]).to(dtype)


def _context_slots(block_table: list[int], seq_len: int, block_size: int,
                   device: torch.device) -> torch.Tensor:
    """``[seq_len]`` int64 cache slots of positions ``0 .. seq_len-1``."""
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = torch.tensor(block_table[:num_blocks], dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    slots = (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:seq_len]
    return slots.to(device)


def _store_new_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Write the step's K/V ``[num_tokens, Hkv, D]`` into their slots (an FP8 cache through
    the KV store's torch reference, which quantizes)."""
    if kv_scales is not None:
        store_kv_reference(k, k_cache, slot_mapping, kv_scales[0])
        store_kv_reference(v, v_cache, slot_mapping, kv_scales[1])
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: PrefillSeq,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
                       dtype: torch.dtype, scale: float) -> torch.Tensor:
    """One prefill's attention: ``q [n, H, D]`` in ``dtype``, ``k``/``v [n, Hkv, D]`` its
    fresh rows -> ``[n, H, D]``."""
    # SDPA operands are 4-D [1, heads, n, D]: torch's CPU flash kernel takes only those (3-D
    # goes to the math path: [H, n, L] scores, 13x slower at 1,500 tokens, measured).
    qp = q.transpose(0, 1)[None]  # [1, H, n, D]
    kernel = takes_prefill(dtype, q.device, q.shape[2])  # C++: AVX512-BF16 bf16, AVX2 fp32
    if p.context_slots is None and kernel:
        return prefill_attention(q, k.to(dtype), v.to(dtype), 0, scale)
    if p.context_slots is None:
        kp = k.to(dtype).transpose(0, 1)[None]
        vp = v.to(dtype).transpose(0, 1)[None]
        op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                            enable_gqa=True)
        return op[0].transpose(0, 1)
    k_scales, v_scales = kv_scales if kv_scales is not None else (None, None)
    kp = _gather(k_cache, k_scales, p.context_slots, dtype)  # [c + n, Hkv, D]
    vp = _gather(v_cache, v_scales, p.context_slots, dtype)
    if kernel and p.query_len > _ROWS_MAX_QUERY:
        return prefill_attention(q, kp, vp, kp.shape[0] - p.query_len, scale)
    kp, vp = kp.transpose(0, 1), vp.transpose(0, 1)  # [Hkv, c + n, D]
    if p.query_len <= _ROWS_MAX_QUERY:
        return _rows_per_kv_head(q, kp, vp, p.mask, scale)
    if q.device.type == "cpu":  # context unmasked + own keys causal, merged (no mask)
        op = context_then_causal(qp, kp[None], vp[None], kp.shape[1] - p.query_len, scale)
        return op[0].transpose(0, 1)
    op = F.scaled_dot_product_attention(qp, kp[None], vp[None], attn_mask=p.mask, scale=scale,
                                        enable_gqa=True)
    return op[0].transpose(0, 1)


class TorchAttentionBackend:
    """Torch reference backend; see the module docstring."""

    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: 16-bit attention runs in fp32 on CPUs without native 16-bit dot products: torch's
        #: CPU flash kernel was 1.3-2x faster in fp32 there (2-core AVX2 EPYC: 1,500-token
        #: prefill 35 vs 47 ms a layer; 32 decodes over 192 tokens 0.8 vs 1.7 ms).
        self.upcast_16bit = device.type == "cpu" and not cpu_has_native_gemm(torch.bfloat16)

    def _compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.upcast_16bit and dtype != torch.float32 else dtype

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        """Decode groups (slots gathered per group) and, per prefill, its context's slots
        and causal mask; see :meth:`AttentionBackend.build_metadata`."""
        bs = inputs.block_size
        nd = inputs.num_decodes
        decode_groups = (_decode_groups(inputs.seq_lens[:nd], inputs.block_tables[:nd], bs,
                                        self.device) if nd else [])
        prefills: list[PrefillSeq] = []
        start = nd
        for i in range(nd, len(inputs.query_lens)):
            q_len, seq_len = inputs.query_lens[i], inputs.seq_lens[i]
            if seq_len == q_len:
                prefills.append(PrefillSeq(start, q_len, None, None))
            else:
                ctx = _context_slots(inputs.block_tables[i], seq_len, bs, self.device)
                q_pos = torch.arange(seq_len - q_len, seq_len, device=self.device)
                k_pos = torch.arange(seq_len, device=self.device)
                mask = k_pos[None, :] <= q_pos[:, None]
                prefills.append(PrefillSeq(start, q_len, ctx, mask))
            start += q_len
        return TorchAttentionMetadata(inputs.slot_mapping, nd, decode_groups, prefills)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`: store, attend each decode group in one SDPA
        call (the query heads of a KV head as its rows), then each prefill."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        q_dtype = q.dtype
        k_scales, v_scales = kv_scales if kv_scales is not None else (None, None)
        _store_new_kv(k, v, k_cache, v_cache, metadata.slot_mapping, kv_scales)
        dtype = self._compute_dtype(q.dtype)
        nd = metadata.num_decodes
        if nd and not metadata.prefills:  # a decode-only step: the output is SDPA's own
            out = None
        else:
            out = torch.empty_like(q)
        q = q.to(dtype)
        group = q.shape[1] // num_kv_heads
        for g in metadata.decode_groups:
            qg = q[:nd] if g.rows is None else q.index_select(0, g.rows)
            n, max_len = g.slots.shape
            # Query heads sharing a KV head become rows of one attention: no K/V repeat.
            qd = qg.view(n, num_kv_heads, group, head_dim)
            slots = g.slots.view(-1)
            kd = _gather(k_cache, k_scales, slots, dtype)
            vd = _gather(v_cache, v_scales, slots, dtype)
            kd = kd.view(n, max_len, num_kv_heads, head_dim).transpose(1, 2)  # [n, Hkv, L, D]
            vd = vd.view(n, max_len, num_kv_heads, head_dim).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
            od = od.reshape(n, -1, head_dim)
            if out is None and g.rows is None:
                return od.to(q_dtype)
            if out is None:
                out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
            if g.rows is None:
                out[:nd] = od
            else:
                out.index_copy_(0, g.rows, od.to(q_dtype))
        for p in metadata.prefills:
            sl = slice(p.query_start, p.query_start + p.query_len)
            out[sl] = _prefill_attention(q[sl], k[sl], v[sl], p, k_cache, v_cache, kv_scales,
                                         dtype, scale)
        return out


register_backend("torch", TorchAttentionBackend)
