"""Rotary position embedding (Su et al. 2021) of q and k in one pass, "rotate half" layout.

Per token, the cos/sin rows are read once and applied to every query and key head::

    out[:half] = x[:half] * cos - x[half:] * sin
    out[half:] = x[half:] * cos + x[:half] * sin

Unfused (``q * cos + rotate_half(q) * sin``, twice) that is about ten passes over q and k
plus a concatenation each; fused it is one read and one write of each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import next_power_of_2
from pdserve.engine.layers.rotary import rotate_half


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, t, num_heads, cos, sin, half,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (i[None, :] < half)
    base = x_ptr + t * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + half, mask=mask, other=0.0)
    dtype = x1.dtype
    # The engine's arithmetic: cos/sin rounded to the model dtype, each product rounded.
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(base, out1.to(dtype), mask=mask)
    tl.store(base + half, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, num_heads, num_kv_heads, half, stride_cos,
                   BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    ok = i < half
    cos = tl.load(cos_ptr + p * stride_cos + i, mask=ok, other=0.0)
    sin = tl.load(sin_ptr + p * stride_cos + i, mask=ok, other=0.0)
    dtype = q_ptr.dtype.element_ty
    cos = cos.to(dtype).to(tl.float32)[None, :]
    sin = sin.to(dtype).to(tl.float32)[None, :]
    _rotate(q_ptr, stride_qt, stride_qh, t, num_heads, cos, sin, half, BLOCK_H, BLOCK_HALF)
    _rotate(k_ptr, stride_kt, stride_kh, t, num_kv_heads, cos, sin, half, BLOCK_KH, BLOCK_HALF)


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cos_cached: torch.Tensor, sin_cached: torch.Tensor) -> None:
    """Rotate ``q`` and ``k`` in place (Triton).

    Args:
        positions: ``[num_tokens]`` int64 absolute positions (< ``max_position``).
        q: ``[num_tokens, num_heads, head_dim]`` (last dim contiguous), in place.
        k: ``[num_tokens, num_kv_heads, head_dim]`` same dtype, in place.
        cos_cached, sin_cached: ``[max_position, head_dim]`` fp32, the halves repeated
            (as :class:`~pdserve.engine.layers.rotary.RotaryEmbedding` stores them).
    """
    num_tokens, num_heads, head_dim = q.shape
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos_cached, sin_cached, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), num_heads, k.shape[1], half, cos_cached.stride(0),
            BLOCK_H=next_power_of_2(num_heads), BLOCK_KH=next_power_of_2(k.shape[1]),
            BLOCK_HALF=next_power_of_2(half))


def apply_rotary_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           cos_cached: torch.Tensor, sin_cached: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`apply_rotary_` (the engine's ``RotaryEmbedding.forward``);
    returns new ``(q, k)``."""
    cos = cos_cached[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
    sin = sin_cached[positions].to(q.dtype).unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
