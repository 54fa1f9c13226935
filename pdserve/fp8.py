"""FP8 e4m3 block quantization of paged KV blocks, with a proven per-element error bound.

One fp32 scale per (layer, K/V, block, KV head): the block's slice for one head
``[block_size, head_dim]`` is scaled by ``1 / s`` with ``s = absmax / 448`` and rounded to the
nearest e4m3fn value, so its largest element lands on 448, the largest finite e4m3fn value::

    kv       [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]  bf16/fp16/fp32
    payload  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]  float8_e4m3fn
    scales   [num_layers, 2, num_blocks,             num_kv_heads          ]  fp32
                                          \\___ reduced: absmax ___/   \\___/

NOTE (error bound). For an element ``x`` of a block with stored scale ``s`` the dequantized
value ``x_hat`` (in ``dtype``, unit roundoff ``u = eps(dtype) / 2``) satisfies

    |x - x_hat| <= (2^-4 + 2*eta) * |x|  +  2^-9 * s  +  tiny(dtype) * eps(dtype)
    with eta = u + 2^-20,

and, for elements in e4m3's normal range (|x| >= 2^-6 s), without the 2^-9 s term.
Why: e4m3 has 3 mantissa bits, normals from 2^-6 to 448, subnormals spaced 2^-9. Rounding
``y`` (|y| <= 448) to nearest gives ``|y - y_hat| <= 2^-4 |y|`` for normal ``y`` (half an
ulp, and an ulp is <= 2^-3 |y|) and ``<= 2^-10`` below 2^-6 (half the subnormal spacing).
Times ``s`` that is ``2^-4 |x|``, resp. ``2^-10 s``. The rest is fp32 and output rounding:
``y = fl(x * fl(1/s))`` is ``x/s`` to within 2 roundings (2^-24 each), the dequantized
``fl32(y_hat * s)`` adds one more, the cast to ``dtype`` one of ``u``; all are relative to
``|x| (1 + 2^-4) + 2^-10 s``, so they fit in ``2*eta*|x|`` and a second 2^-10 s. The last
term covers the output dtype's subnormal range (fp16 below 6.1e-5). Since
``|x| <= absmax = 448 s``, per block: ``max |x - x_hat| <= absmax * (2^-4 + 2*eta +
2^-9/448)`` (+ the tiny term), about 6.3 % of the block's absmax for bf16 output. Small
values in a block with a huge outlier fall below 2^-6 s and keep only the absolute bound.

No NaN is produced: ``|y|`` is at most three fp32 roundings above 448 and rounds to 448
(the next e4m3fn value would be 480). All-zero blocks, and blocks with absmax below
``448 * 2^-126`` (~5.3e-36, where ``1/s`` would overflow), get scale 1.0 and exact zeros,
within the bound. Non-finite input raises ``ValueError``.

CPU speed: where :func:`pdserve.fp8_cpu.fp8_kernels` builds (AVX2 + F16C and a C compiler),
quantize and dequantize run as one C pass per (layer, K/V, block) row with the same bits
as the torch path below, and :func:`quantize_cache_blocks` / :func:`dequantize_into_cache`
fuse the gather out of / scatter into a paged cache. The torch path (the reference; also
``use_kernels=False``): the work goes through reusable scratch chunks of ``_CHUNK_ELEMS`` elements
(cache-sized; fresh multi-MB tensors fault every 4 KiB page here). torch's fp8 -> float
cast is scalar (~0.14 G elements/s), so dequantization reads the codes as fp16 bits::

    e4m3 code  s eeee mmm  --int16 << 7, clear bit 14-->  s 0eeee mmm0000000  (fp16 bits)

which is the fp8 value times 2^-8 exactly, subnormals included (fp16 subnormals cover
e4m3's); the scale is pre-multiplied by 2^8. NaN codes (0x7f, 0xff) would decode as
+-480; the quantizer never writes them and the wire checksum rejects corrupted bytes.
"""

from __future__ import annotations

import torch

from pdserve.fp8_cpu import fp8_kernels
from pdserve.host_memory import empty_host

FP8_E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Elements per scratch chunk: ~2 MiB of fp32, small enough to stay in a core's L2.
_CHUNK_ELEMS = 1 << 19
# Scales below the smallest normal fp32 would make 1/scale overflow (absmax < ~5.3e-36).
_MIN_NORMAL_SCALE = torch.finfo(torch.float32).tiny
# 0xBFFF as int16: keeps the sign (bit 15), clears bit 14 that sign extension set.
_FP16_CLEAR_BIT14 = -16385


def quantize_blocks(kv: torch.Tensor, *, use_kernels: bool = True,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize KV blocks to FP8 e4m3 with one scale per (layer, K/V, block, KV head).

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] bf16/fp16/fp32.
    use_kernels: False runs the torch reference path (the C kernels give the same bits).
    Returns (payload, scales):
      payload [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] float8_e4m3fn,
      scales  [num_layers, 2, num_blocks, num_kv_heads] fp32 (absmax / 448, 1.0 for zeros).
    Raises ValueError for a wrong rank or dtype, or non-finite values.
    """
    _check_kv(kv)
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv.shape
    num_rows = num_layers * 2 * num_blocks
    payload = empty_host(tuple(kv.shape), FP8_DTYPE)
    scales = torch.empty((num_layers, 2, num_blocks, num_kv_heads), dtype=SCALE_DTYPE)
    if num_rows == 0:
        return payload, scales
    rows = kv.contiguous().view(num_rows, block_size, num_kv_heads, head_dim)
    out_rows = payload.view(num_rows, block_size, num_kv_heads, head_dim)
    out_scales = scales.view(num_rows, num_kv_heads)
    kernels = fp8_kernels() if use_kernels else None
    if kernels is not None:  # one pass, same bits (pdserve/fp8_cpu.c)
        if kernels.quantize_rows(rows, None, out_rows, out_scales):
            raise ValueError("kv: contains inf or NaN; cannot quantize to FP8")
        return payload, scales
    _quantize_rows_torch(rows, out_rows, out_scales)
    return payload, scales


def _quantize_rows_torch(rows: torch.Tensor, out_rows: torch.Tensor,
                         out_scales: torch.Tensor) -> None:
    """The reference path: rows [n, block_size, H, D] -> out_rows (e4m3), out_scales [n, H]."""
    num_rows, block_size, num_kv_heads, head_dim = rows.shape

    chunk = _rows_per_chunk(block_size * num_kv_heads * head_dim, num_rows)
    work = torch.empty((chunk, block_size, num_kv_heads, head_dim), dtype=torch.float32)
    work_abs = torch.empty_like(work)
    for start in range(0, num_rows, chunk):
        end = min(start + chunk, num_rows)
        w = work[: end - start]                          # [c, block_size, H, D] fp32
        w.copy_(rows[start:end])
        scale = out_scales[start:end]                    # [c, H] fp32, filled in place
        torch.amax(torch.abs(w, out=work_abs[: end - start]), dim=(1, 3), out=scale)
        scale.div_(FP8_E4M3_MAX)
        # Zero blocks, and blocks so tiny that 1/scale would overflow, become exact zeros.
        scale.masked_fill_(scale < _MIN_NORMAL_SCALE, 1.0)
        w.mul_(torch.reciprocal(scale)[:, None, :, None])
        out_rows[start:end].copy_(w)
    if not bool(torch.isfinite(out_scales).all()):
        raise ValueError("kv: contains inf or NaN; cannot quantize to FP8")


def dequantize_blocks(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor | None = None, *, use_kernels: bool = True,
                      ) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: ``payload * scale`` rounded to ``dtype``.

    payload: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
             float8_e4m3fn or uint8 (the same bytes).
    scales:  [num_layers, 2, num_blocks, num_kv_heads] fp32.
    out:     optional contiguous destination of payload's shape and ``dtype``.
    use_kernels: False runs the torch reference path (the C kernels give the same bits).
    Returns [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] ``dtype``.
    """
    if payload.dtype not in (FP8_DTYPE, torch.uint8) or payload.dim() != 6:
        raise ValueError(f"payload: expected a 6-d float8_e4m3fn/uint8 tensor, "
                         f"got {payload.dim()}-d {payload.dtype}")
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = payload.shape
    if tuple(scales.shape) != (num_layers, 2, num_blocks, num_kv_heads) \
            or scales.dtype != SCALE_DTYPE:
        raise ValueError(f"scales: expected fp32 {(num_layers, 2, num_blocks, num_kv_heads)}, "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    if dtype not in KV_DTYPES:
        raise ValueError(f"dtype: expected one of {KV_DTYPES}, got {dtype}")
    if out is None:
        out = empty_host(tuple(payload.shape), dtype)
    elif out.shape != payload.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous {dtype} {tuple(payload.shape)}")
    num_rows = num_layers * 2 * num_blocks
    if num_rows == 0:
        return out
    row_shape = (block_size, num_kv_heads, head_dim)
    codes = payload.contiguous().view(torch.uint8).view(num_rows, *row_shape)
    row_scales = scales.contiguous().view(num_rows, num_kv_heads)
    kernels = fp8_kernels() if use_kernels else None
    if kernels is not None:  # one pass, same bits (pdserve/fp8_cpu.c)
        kernels.dequantize_rows(codes, row_scales, out, None)
    else:
        _dequantize_rows_torch(codes, row_scales, out.view(num_rows, *row_shape))
    return out


def _dequantize_rows_torch(codes: torch.Tensor, scales: torch.Tensor,
                           out_rows: torch.Tensor) -> None:
    """The reference path: codes [n, block_size, H, D] uint8, scales [n, H] -> out_rows."""
    num_rows, *row_shape = codes.shape
    block_size, num_kv_heads, head_dim = row_shape
    codes = codes.view(torch.int8)
    # [num_rows, H] fp32; x256 undoes the 2^-8 of the fp16 view below (exact: power of 2).
    row_scales = scales * 256.0

    chunk = _rows_per_chunk(block_size * num_kv_heads * head_dim, num_rows)
    bits = torch.empty((chunk, *row_shape), dtype=torch.int16)
    work = torch.empty((chunk, *row_shape), dtype=torch.float32)
    for start in range(0, num_rows, chunk):
        end = min(start + chunk, num_rows)
        b = bits[: end - start]                          # [c, block_size, H, D] int16
        w = work[: end - start]                          # [c, block_size, H, D] fp32
        b.copy_(codes[start:end])                        # sign-extends s.eeee.mmm
        b.bitwise_left_shift_(7).bitwise_and_(_FP16_CLEAR_BIT14)
        w.copy_(b.view(torch.float16))                   # = fp8 value * 2^-8, exactly
        w.mul_(row_scales[start:end, None, :, None])
        out_rows[start:end].copy_(w)


def quantize_cache_blocks(cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int,
                          layer_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather and quantize in one pass: layers [layer_start, layer_end) of ``block_ids``.

    cache: [num_layers, 2, num_cache_blocks, block_size, H, D] bf16/fp16/fp32, contiguous.
    block_ids: [n] int64, in [0, num_cache_blocks).
    Returns what ``quantize_blocks(cache[layer_start:layer_end, :, block_ids])`` returns
    (the same bits): payload [L, 2, n, block_size, H, D] float8_e4m3fn, scales [L, 2, n, H].
    Raises ValueError as quantize_blocks, or for ids or layers outside the cache.
    """
    _check_kv(cache)
    kernels = fp8_kernels()
    if kernels is None or not cache.is_contiguous():
        return quantize_blocks(cache[layer_start:layer_end].index_select(2, block_ids))
    _, _, num_cache_blocks, block_size, num_kv_heads, head_dim = cache.shape
    num_layers, n = layer_end - layer_start, block_ids.numel()
    payload = empty_host((num_layers, 2, n, block_size, num_kv_heads, head_dim), FP8_DTYPE)
    scales = torch.empty((num_layers, 2, n, num_kv_heads), dtype=SCALE_DTYPE)
    offsets = cache_row_offsets(cache, block_ids, layer_start, layer_end)
    if kernels.quantize_rows(cache, offsets, payload.view(-1, block_size, num_kv_heads,
                                                          head_dim).view(torch.uint8),
                             scales.view(-1, num_kv_heads)):
        raise ValueError("kv: contains inf or NaN; cannot quantize to FP8")
    return payload, scales


def dequantize_into_cache(payload: torch.Tensor, scales: torch.Tensor, cache: torch.Tensor,
                          block_ids: torch.Tensor, layer_start: int) -> None:
    """Dequantize and scatter in one pass: write ``payload * scale`` into ``cache`` at
    ``block_ids``, layers ``layer_start ..`` (the same bits as dequantize_blocks, then
    ``index_copy_``).

    payload: [L, 2, n, block_size, H, D] float8_e4m3fn/uint8; scales [L, 2, n, H] fp32.
    cache: [num_layers, 2, num_cache_blocks, block_size, H, D] bf16/fp16/fp32, written.
    block_ids: [n] int64 destination blocks, in order.
    Raises ValueError for shapes that do not fit, or ids or layers outside the cache.
    """
    _check_kv(cache)
    layer_end = layer_start + payload.shape[0]
    if payload.dim() != 6 or payload.shape[3:] != cache.shape[3:] \
            or payload.shape[2] != block_ids.numel():
        raise ValueError(f"payload: {tuple(payload.shape)} does not fit {block_ids.numel()} "
                         f"blocks of a cache {tuple(cache.shape)}")
    kernels = fp8_kernels()
    if kernels is None or not cache.is_contiguous():
        values = dequantize_blocks(payload, scales, cache.dtype)
        cache[layer_start:layer_end].index_copy_(2, block_ids, values)
        return
    block_size, num_kv_heads, head_dim = cache.shape[3:]
    offsets = cache_row_offsets(cache, block_ids, layer_start, layer_end)
    kernels.dequantize_rows(
        payload.contiguous().view(torch.uint8).view(-1, block_size, num_kv_heads, head_dim),
        scales.contiguous().view(-1, num_kv_heads), cache, offsets)


def cache_row_offsets(cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int,
                      layer_end: int) -> torch.Tensor:
    """[L * 2 * n] int64 element offsets of rows (layer, K/V, block_ids[i]) in a contiguous
    ``cache [num_layers, 2, num_cache_blocks, block_size, H, D]``, in that order.
    Raises ValueError for ids or layers outside the cache."""
    num_layers, _, num_cache_blocks = cache.shape[:3]
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    if not 0 <= layer_start < layer_end <= num_layers:
        raise ValueError(f"layers [{layer_start}, {layer_end}) outside the cache's {num_layers}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_cache_blocks):
        raise ValueError(f"block_ids: must be in [0, {num_cache_blocks})")
    planes = torch.arange(2 * layer_start, 2 * layer_end, dtype=torch.int64) * num_cache_blocks
    return ((planes[:, None] + ids[None, :]) * cache[0, 0, 0].numel()).reshape(-1)


def fp8_e4m3_values() -> torch.Tensor:
    """The value of every e4m3fn byte pattern: [256] fp32 (index = the byte; 0x7f/0xff NaN)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(torch.float32)


def fp8_error_bound(kv: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on |kv - dequantize(quantize(kv))| (see the module NOTE).

    kv:     [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] any float dtype.
    scales: [num_layers, 2, num_blocks, num_kv_heads] fp32, as returned by quantize_blocks.
    Returns a float64 tensor of kv's shape.
    """
    info = torch.finfo(dtype)
    eta = info.eps / 2 + 2.0 ** -20
    s = scales.to(torch.float64)[:, :, :, None, :, None]
    return ((2.0 ** -4 + 2 * eta) * kv.to(torch.float64).abs()
            + 2.0 ** -9 * s + info.tiny * info.eps)


def _rows_per_chunk(row_elems: int, num_rows: int) -> int:
    return max(1, min(num_rows, _CHUNK_ELEMS // max(1, row_elems)))


def _check_kv(kv: torch.Tensor) -> None:
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError("kv: expected [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(kv.shape)}")
    if kv.dtype not in KV_DTYPES:
        raise ValueError(f"kv: expected dtype in {KV_DTYPES}, got {kv.dtype}")
    if kv.device.type != "cpu":
        raise ValueError(f"kv: the torch FP8 path runs on CPU tensors, got {kv.device}")
