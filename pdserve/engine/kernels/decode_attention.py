"""Paged decode attention: one query token per request over its paged K/V (PagedAttention,
Kwon et al. 2023), with the online softmax of FlashAttention (Dao et al. 2022).

One program per (request, KV head) handles the ``group = num_heads / num_kv_heads`` query
heads that share the KV head, so each K/V tile is read once for the whole group (GQA). The
context is walked in tiles of ``BLOCK_N`` positions; each position's block id is read from
the block table, so any block size works::

    position p -> block_tables[r, p // block_size] * block_size + p % block_size

FP8 caches are dequantized tile by tile with the per-(block, KV head) scale. Rows with
``seq_len == 0`` (CUDA-graph padding) produce zeros. All metadata is tensors, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import next_power_of_2


@triton.jit
def load_kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, pos, p_ok, kvh, d, num_kv_heads,
                 head_dim, block_size, IS_FP8: tl.constexpr):
    """K and V ``[BLOCK_N, BLOCK_D]`` of one KV head at context positions ``pos`` (through
    the request's block table row ``table_ptr``); masked positions read 0. FP8 codes come
    back dequantized in fp32, other caches in their dtype."""
    blk = tl.load(table_ptr + pos // block_size, mask=p_ok, other=0).to(tl.int64)
    row = (blk * block_size + pos % block_size) * num_kv_heads + kvh
    kv_off = row[:, None] * head_dim + d[None, :]
    kv_mask = p_ok[:, None] & (d[None, :] < head_dim)
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    if IS_FP8:
        k = k.to(tl.float32) * tl.load(ks_ptr + blk * num_kv_heads + kvh, mask=p_ok,
                                       other=0.0)[:, None]
        v = v.to(tl.float32) * tl.load(vs_ptr + blk * num_kv_heads + kvh, mask=p_ok,
                                       other=0.0)[:, None]
    return k, v


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, out_ptr,
                   scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, num_kv_heads,
                   head_dim, block_size,
                   GROUP: tl.constexpr, IS_FP8: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + r)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < head_dim
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + r * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + n
        p_ok = pos < seq_len
        k, v = load_kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr + r * stride_bt, pos, p_ok, kvh,
                            d, num_kv_heads, head_dim, block_size, IS_FP8)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                # [G, N]
        s = tl.where(p_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + r * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per request over its paged context (Triton).

    Args:
        q: ``[num_reqs, num_heads, head_dim]`` (last dim contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous,
            compute dtype or ``float8_e4m3fn``.
        block_tables: ``[num_reqs, max_blocks]`` int32; entries past a request's context
            are never read.
        seq_lens: ``[num_reqs]`` int32 context lengths (the new token included); 0 = padding.
        scale: softmax scale.
        k_scales, v_scales: ``[num_blocks, num_kv_heads]`` fp32, required for FP8 caches.
        out: optional ``[num_reqs, num_heads, head_dim]`` destination (last dim contiguous).

    Returns:
        ``[num_reqs, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: an FP8 cache without scales.
    """
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if is_fp8 and (k_scales is None or v_scales is None):
        raise ValueError("an FP8 cache needs k_scales and v_scales")
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    dummy = seq_lens  # any tensor: the scale pointers are unused without FP8
    _decode_kernel[(num_reqs, num_kv_heads)](
        q, k_cache, v_cache, k_scales if is_fp8 else dummy, v_scales if is_fp8 else dummy,
        block_tables, seq_lens, out, scale, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0),
        num_kv_heads, head_dim, block_size, GROUP=group, IS_FP8=is_fp8,
        BLOCK_G=next_power_of_2(group), BLOCK_N=max(16, min(64, next_power_of_2(block_size))),
        BLOCK_D=next_power_of_2(head_dim))
    return out


def dequantize_cache(cache: torch.Tensor, scales: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """``[num_blocks, block_size, H, D]`` cache in ``dtype`` (FP8 codes times their scale)."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache.to(dtype)
    return (cache.float() * scales[:, None, :, None]).to(dtype)


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor,
                                     v_cache: torch.Tensor, block_tables: torch.Tensor,
                                     seq_lens: torch.Tensor, scale: float,
                                     k_scales: torch.Tensor | None = None,
                                     v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`paged_decode_attention`: fp32 softmax per request."""
    k_all = dequantize_cache(k_cache, k_scales, torch.float32)
    v_all = dequantize_cache(v_cache, v_scales, torch.float32)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for r, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[r, pos // block_size].long()
        k = k_all[blocks, pos % block_size].repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_all[blocks, pos % block_size].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[r].float() * scale, k)
        out[r] = torch.einsum("hl,lhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
