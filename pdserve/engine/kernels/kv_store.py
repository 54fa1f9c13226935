"""Write new K/V rows into the paged cache, optionally quantizing to FP8 e4m3 on the way.

Cache layout (one layer, K or V)::

    cache   [num_blocks, block_size, num_kv_heads, head_dim]   bf16/fp16/fp32 or float8_e4m3fn
    scales  [num_blocks, num_kv_heads]                          fp32 (FP8 caches only)
    slot = block_id * block_size + offset

FP8 quantization is the KV wire format's (:mod:`pdserve.fp8`): one scale per
(block, KV head), ``code = rne_e4m3(x * fl(1/scale))``, value ``= code * scale``. A block
written whole in one step (a prefill's full blocks) gets ``scale = absmax / 448``, exactly
what :func:`~pdserve.fp8.quantize_blocks` computes, so a prefill worker with an
FP8 cache can ship its blocks and scales as they are.

NOTE (blocks that fill over several steps). A block's first write fixes
``scale = absmax(first tokens) / 448``. A later write to the same block whose absmax still
fits (``<= 448 * scale``) is quantized with that scale. One that does not fit grows the
scale by the smallest power of two ``2^k`` that makes it fit, and the codes already in the
block are re-coded ``code * 2^-k``: an exact exponent shift for codes that stay in e4m3's
normal range; codes pushed below ``2^-6`` round to the subnormal grid, an error of at most
``2^-10 * scale_new`` each time. Because each growth at least doubles the scale, those
errors over any number of growths sum to less than ``2^-9 * scale_final``, so for every
element::

    |x - x_hat| <= 2^-4 |x|  +  2^-9 * scale_first  +  2^-9 * scale_final  (+ fp32 roundings)
               <= 2^-4 |x|  +  2^-8 * scale_final

which is at most ``absmax * (2^-4 + 2^-8 * 2 / 448)`` for the block (the grown scale is
below ``2 * absmax / 448``): the wire format's bound with a doubled subnormal term, and no
compounding however many tokens are appended. A block whose stored codes are all zero is
treated as fresh.

Segments: the FP8 store runs one program per (segment, KV head), a segment being a run of
consecutive batch tokens that land in one block (``token_starts``/``num_tokens`` tensors,
built by :func:`store_segments`), so each program sees a block's old and new tokens together.
Slots equal to :data:`~pdserve.engine.kernels.PAD_SLOT_ID` (padding) are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import next_power_of_2

FP8_E4M3_MAX = 448.0
#: Scales below the smallest normal fp32 would overflow ``1/scale``; such blocks get 1.0.
_MIN_SCALE = float(torch.finfo(torch.float32).tiny)


def store_segments(query_lens: list[int], seq_lens: list[int], block_size: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split each request's new tokens at block boundaries.

    Args:
        query_lens: per request, new tokens this step (batch order).
        seq_lens: per request, context length after this step.
        block_size: tokens per block.

    Returns:
        ``(token_starts, num_tokens)``: ``[num_segments]`` int32 each; segment ``i`` is batch
        tokens ``token_starts[i] .. + num_tokens[i]``, all in one block.
    """
    starts: list[int] = []
    lens: list[int] = []
    tok = 0
    for q_len, seq_len in zip(query_lens, seq_lens):
        pos = seq_len - q_len
        while pos < seq_len:
            n = min(seq_len, (pos // block_size + 1) * block_size) - pos
            starts.append(tok)
            lens.append(n)
            tok += n
            pos += n
    return (torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor(lens, dtype=torch.int32, device=device))


@triton.jit
def _broadcast_flag(flag, like):
    """A scalar bool as a tensor shaped like ``like`` (the interpreter cannot mix the two)."""
    return (like * 0 + flag.to(tl.int32)) > 0


@triton.jit
def _round_to_e4m3(y):
    """Round fp32 ``y`` (``|y| <= 448``) to the nearest e4m3 value, ties to even, in fp32.

    The cast that follows is then exact. Done explicitly because Triton 3.9's interpreter
    mis-rounds float -> e4m3 casts (carries into the exponent, subnormals); on GPU it costs a
    few ALU ops in a memory-bound kernel and gives the same codes as the hardware cast.
    """
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_log2 = (tl.maximum(exponent, -6) - 3).to(tl.float32)      # e4m3: 3 mantissa bits
    z = y * tl.math.exp2(-step_log2)                                # |z| < 16, exact
    rne_magic = 12582912.0                                          # 1.5 * 2^23
    return ((z + rne_magic) - rne_magic) * tl.math.exp2(step_log2)


@triton.jit
def _store_kernel(x_ptr, cache_ptr, slot_ptr, stride_xt, stride_xh, num_kv_heads, head_dim,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: copy its [num_kv_heads, head_dim] row into its slot."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim) \
        & _broadcast_flag(slot >= 0, h)[:, None]
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask)
    dst = cache_ptr + slot * num_kv_heads * head_dim + h[:, None] * head_dim + d[None, :]
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_fp8_kernel(x_ptr, cache_ptr, scales_ptr, slot_ptr, seg_start_ptr, seg_len_ptr,
                      stride_xt, stride_xh, num_kv_heads, head_dim, block_size,
                      FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (segment, KV head); see the module NOTE for the scale rule."""
    seg = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(seg_start_ptr + seg)
    n = tl.load(seg_len_ptr + seg)
    slot0 = tl.load(slot_ptr + start).to(tl.int64)
    is_real = slot0 >= 0
    blk = slot0 // block_size
    off0 = slot0 % block_size
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    d_ok = d[None, :] < head_dim
    real_t = _broadcast_flag(is_real, t)[:, None]
    new_mask = (t[:, None] < n) & d_ok & real_t
    x = tl.load(x_ptr + (start + t)[:, None] * stride_xt + h * stride_xh + d[None, :],
                mask=new_mask, other=0.0).to(tl.float32)
    amax_new = tl.max(tl.max(tl.abs(x), axis=1), axis=0)

    row = cache_ptr + (blk * block_size + t[:, None]) * num_kv_heads * head_dim \
        + h * head_dim + d[None, :]
    old_mask = (t[:, None] < off0) & d_ok & real_t
    old = tl.load(row, mask=old_mask, other=0.0).to(tl.float32)
    has_old = tl.max(tl.max(tl.abs(old), axis=1), axis=0) > 0.0
    old_scale = tl.load(scales_ptr + blk * num_kv_heads + h, mask=is_real, other=1.0)

    fresh = amax_new / FP8_MAX
    fresh = tl.where(fresh < MIN_SCALE, 1.0, fresh)
    ratio = amax_new / (old_scale * FP8_MAX)
    k = tl.where(ratio > 1.0, tl.math.ceil(tl.math.log2(ratio)), 0.0)
    grown = old_scale * tl.math.exp2(k)
    too_small = amax_new * tl.math.div_rn(1.0, grown) > FP8_MAX
    k = tl.where(too_small, k + 1.0, k)
    grown = tl.where(too_small, grown * 2.0, grown)
    scale = tl.where(has_old, grown, fresh)
    inv = tl.math.div_rn(1.0, scale)

    # Re-code the block's earlier tokens when its scale grew: an exact exponent shift.
    shifted = _round_to_e4m3(old * tl.math.exp2(-k))
    do_shift = _broadcast_flag(has_old & (k > 0.0), t)[:, None]
    tl.store(row, shifted.to(cache_ptr.dtype.element_ty), mask=old_mask & do_shift)
    y = _round_to_e4m3(tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX))
    new_row = cache_ptr + (slot0 + t[:, None]) * num_kv_heads * head_dim \
        + h * head_dim + d[None, :]
    tl.store(new_row, y.to(cache_ptr.dtype.element_ty), mask=new_mask)
    tl.store(scales_ptr + blk * num_kv_heads + h, scale, mask=is_real)


def store_kv(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
             scales: torch.Tensor | None = None,
             segments: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write ``x`` into ``cache`` at ``slot_mapping`` (Triton), quantizing for FP8 caches.

    Args:
        x: ``[num_tokens, num_kv_heads, head_dim]`` K or V (last dim contiguous).
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous, written in
            place; ``float8_e4m3fn`` for an FP8 cache.
        slot_mapping: ``[num_tokens]`` int32/int64 slots; ``PAD_SLOT_ID`` skips a token.
        scales: ``[num_blocks, num_kv_heads]`` fp32, in place; required iff FP8.
        segments: ``(token_starts, num_tokens)`` from :func:`store_segments`; required iff FP8.

    Raises:
        ValueError: an FP8 cache without scales or segments.
    """
    num_tokens, num_kv_heads, head_dim = x.shape
    block_size = cache.shape[1]
    if cache.dtype != torch.float8_e4m3fn:
        if num_tokens:
            _store_kernel[(num_tokens,)](
                x, cache, slot_mapping, x.stride(0), x.stride(1), num_kv_heads, head_dim,
                BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim))
        return
    if scales is None or segments is None:
        raise ValueError("an FP8 cache needs scales and segments")
    starts, lens = segments
    if starts.numel():
        _store_fp8_kernel[(starts.numel(), num_kv_heads)](
            x, cache, scales, slot_mapping, starts, lens, x.stride(0), x.stride(1),
            num_kv_heads, head_dim, block_size, FP8_MAX=FP8_E4M3_MAX, MIN_SCALE=_MIN_SCALE,
            BLOCK_T=next_power_of_2(block_size), BLOCK_D=next_power_of_2(head_dim))


def store_kv_reference(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                       scales: torch.Tensor | None = None) -> None:
    """Torch reference of :func:`store_kv` (the torch backend's store); same arguments.

    Segments are derived from ``slot_mapping`` itself (runs of equal ``slot // block_size``),
    which costs one host sync.
    """
    if cache.dtype != torch.float8_e4m3fn:
        keep = slot_mapping >= 0
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, slot_mapping[keep].long(), x[keep].to(cache.dtype))
        return
    if scales is None:
        raise ValueError("an FP8 cache needs scales")
    keep = slot_mapping >= 0
    slots, x = slot_mapping[keep].long(), x[keep].float()  # [T], [T, H, D] fp32
    if not slots.numel():
        return
    block_size = cache.shape[1]
    blocks = slots // block_size
    is_first = torch.ones_like(blocks, dtype=torch.bool)
    is_first[1:] = (blocks[1:] != blocks[:-1]) | (slots[1:] != slots[:-1] + 1)
    seg_of_token = torch.cumsum(is_first.long(), 0) - 1               # [T]
    seg_blocks, seg_off0 = blocks[is_first], slots[is_first] % block_size  # [S]
    num_segs, num_heads = seg_blocks.numel(), x.shape[1]
    amax_new = torch.zeros((num_segs, num_heads), dtype=torch.float32, device=x.device)
    amax_new.scatter_reduce_(0, seg_of_token[:, None].expand(-1, num_heads),
                             x.abs().amax(-1), "amax")                # [S, H]

    old_codes = cache.view(torch.uint8)[seg_blocks].view(cache.dtype).float()  # [S, bs, H, D]
    pos = torch.arange(block_size, device=x.device)
    is_old = pos[None, :] < seg_off0[:, None]                          # [S, bs]
    old_codes = old_codes * is_old[:, :, None, None]
    has_old = old_codes.abs().amax(dim=(1, 3)) > 0                     # [S, H]
    old_scale = scales[seg_blocks]                                     # [S, H]
    fresh = amax_new / FP8_E4M3_MAX
    fresh = torch.where(fresh < _MIN_SCALE, torch.ones_like(fresh), fresh)
    ratio = amax_new / (old_scale * FP8_E4M3_MAX)
    k = torch.where(ratio > 1, torch.ceil(torch.log2(ratio)), torch.zeros_like(ratio))
    grown = old_scale * torch.exp2(k)
    too_small = amax_new * torch.reciprocal(grown) > FP8_E4M3_MAX
    k = torch.where(too_small, k + 1, k)
    grown = torch.where(too_small, grown * 2, grown)
    new_scale = torch.where(has_old, grown, fresh)                     # [S, H]

    codes = cache.view(torch.uint8)  # fp8 has few CPU kernels; move its bytes instead
    regrow = (has_old & (k > 0)).any(-1)                               # [S]
    if bool(regrow.any()):
        shifted = old_codes[regrow] * torch.exp2(-k[regrow])[:, None, :, None]
        grown_blocks = seg_blocks[regrow]
        codes[grown_blocks] = torch.where(is_old[regrow][:, :, None, None],
                                          shifted.to(cache.dtype).view(torch.uint8),
                                          codes[grown_blocks])
    inv = torch.reciprocal(new_scale)[seg_of_token]                    # [T, H]
    y = (x * inv[:, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    codes.view(-1, *cache.shape[2:]).index_copy_(0, slots, y.to(cache.dtype).view(torch.uint8))
    scales[seg_blocks] = new_scale
