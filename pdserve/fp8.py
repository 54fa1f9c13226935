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

CPU speed: the work goes through reusable scratch chunks of ``_CHUNK_ELEMS`` elements
(cache-sized; fresh multi-MB tensors fault every 4 KiB page here). torch's fp8 -> float
cast is scalar (~0.14 G elements/s), so dequantization reads the codes as fp16 bits::

    e4m3 code  s eeee mmm  --int16 << 7, clear bit 14-->  s 0eeee mmm0000000  (fp16 bits)

which is the fp8 value times 2^-8 exactly, subnormals included (fp16 subnormals cover
e4m3's); the scale is pre-multiplied by 2^8. NaN codes (0x7f, 0xff) would decode as
+-480; the quantizer never writes them and the wire checksum rejects corrupted bytes.
"""

from __future__ import annotations

import torch

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


def quantize_blocks(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize KV blocks to FP8 e4m3 with one scale per (layer, K/V, block, KV head).

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] bf16/fp16/fp32.
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
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("kv: contains inf or NaN; cannot quantize to FP8")
    return payload, scales


def dequantize_blocks(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: ``payload * scale`` rounded to ``dtype``.

    payload: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
             float8_e4m3fn or uint8 (the same bytes).
    scales:  [num_layers, 2, num_blocks, num_kv_heads] fp32.
    out:     optional contiguous destination of payload's shape and ``dtype``.
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
    codes = payload.contiguous().view(torch.int8).view(num_rows, *row_shape)
    # [num_rows, H] fp32; x256 undoes the 2^-8 of the fp16 view below (exact: power of 2).
    row_scales = scales.contiguous().view(num_rows, num_kv_heads) * 256.0
    out_rows = out.view(num_rows, *row_shape)

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
    return out


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
