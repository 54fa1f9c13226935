"""Varlen causal prefill attention over the paged cache, cached prefixes included
(FlashAttention, Dao et al. 2022, over PagedAttention's block tables, Kwon et al. 2023).

Request ``r`` computes ``query_len = cu_query_lens[r+1] - cu_query_lens[r]`` new tokens at
positions ``seq_len - query_len .. seq_len - 1``; its whole context (cached prefix and the
new tokens, already stored by the KV store) is read from the paged cache. Query token ``i``
attends to positions ``<= seq_len - query_len + i``::

    keys:    | cached prefix (ctx) | new tokens (query_len) |
    query i:  attends to ---------------------------> ctx + i

One program per (request, query head, tile of ``BLOCK_M`` queries), walking the context in
tiles of ``BLOCK_N`` with the online softmax; tiles past the tile's last query are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import is_interpreted, next_power_of_2
from pdserve.engine.kernels.decode_attention import dequantize_cache, load_kv_tile


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr,
                    scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, num_kv_heads,
                    head_dim, block_size,
                    GROUP: tl.constexpr, IS_FP8: tl.constexpr, DOT_FP32: tl.constexpr,
                    PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    kvh = h // GROUP
    q_start = tl.load(cu_q_ptr + r)
    q_len = tl.load(cu_q_ptr + r + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + r)
    ctx = seq_len - q_len
    m = m_start + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_ok = m < q_len
    d_ok = d < head_dim
    q_mask = m_ok[:, None] & d_ok[None, :]
    q_off = (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = ctx + m                                                     # [M]
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    end = tl.minimum(seq_len, ctx + m_start + BLOCK_M)
    end = tl.where(m_start < q_len, end, 0)
    n = tl.arange(0, BLOCK_N)
    for start in range(0, end, BLOCK_N):
        pos = start + n
        p_ok = pos < seq_len
        k, v = load_kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr + r * stride_bt, pos, p_ok, kvh,
                            d, num_kv_heads, head_dim, block_size, IS_FP8)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale   # [M, N] fp32
        causal = (pos[None, :] <= q_pos[:, None]) & p_ok[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, scale: float,
                            k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context (Triton).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; request ``r`` owns rows
            ``cu_query_lens[r] .. cu_query_lens[r+1]`` (rows outside are not touched).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous,
            already holding the new tokens' K/V; compute dtype or ``float8_e4m3fn``.
        block_tables: ``[num_reqs, max_blocks]`` int32.
        cu_query_lens: ``[num_reqs + 1]`` int32 row offsets into ``q``.
        seq_lens: ``[num_reqs]`` int32 context lengths after this step.
        max_query_len: the largest query length (sets the grid; host int).
        scale: softmax scale.
        k_scales, v_scales: ``[num_blocks, num_kv_heads]`` fp32, required for FP8 caches.
        out: optional destination shaped like ``q`` (last dim contiguous).

    Returns:
        ``out`` (or a new tensor like ``q``) with the requests' rows written.

    Raises:
        ValueError: an FP8 cache without scales.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if is_fp8 and (k_scales is None or v_scales is None):
        raise ValueError("an FP8 cache needs k_scales and v_scales")
    if out is None:
        out = torch.empty_like(q)
    num_reqs = seq_lens.numel()
    if num_reqs == 0 or max_query_len == 0:
        return out
    block_m = max(16, min(64, next_power_of_2(max_query_len)))
    block_n = 32
    dummy = seq_lens
    grid = (num_reqs, num_heads, triton.cdiv(max_query_len, block_m))
    dot_fp32 = q.dtype == torch.float32 or is_interpreted(_prefill_kernel)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scales if is_fp8 else dummy, v_scales if is_fp8 else dummy,
        block_tables, cu_query_lens, seq_lens, out, scale, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), num_kv_heads, head_dim, block_size,
        GROUP=num_heads // num_kv_heads, IS_FP8=is_fp8,
        # Triton 3.9's interpreter mis-multiplies 16-bit tl.dot operands: upcast there.
        DOT_FP32=dot_fp32, PRECISION="ieee" if dot_fp32 else "tf32",  # (fp32 operands only)
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_power_of_2(head_dim)))
    return out


def paged_prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor,
                                      v_cache: torch.Tensor, block_tables: torch.Tensor,
                                      cu_query_lens: torch.Tensor, seq_lens: torch.Tensor,
                                      scale: float, k_scales: torch.Tensor | None = None,
                                      v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`paged_prefill_attention`: fp32 masked softmax per request.

    Rows of ``q`` outside every request come back as zeros.
    """
    k_all = dequantize_cache(k_cache, k_scales, torch.float32)
    v_all = dequantize_cache(v_cache, v_scales, torch.float32)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    cu = cu_query_lens.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q_len = cu[r + 1] - cu[r]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[r, pos // block_size].long()
        k = k_all[blocks, pos % block_size].repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_all[blocks, pos % block_size].repeat_interleave(group, dim=1)
        qr = q[cu[r]:cu[r + 1]].float() * scale                             # [n, H, D]
        s = torch.einsum("nhd,lhd->hnl", qr, k)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[cu[r]:cu[r + 1]] = torch.einsum("hnl,lhd->nhd", s.softmax(-1), v).to(q.dtype)
    return out
