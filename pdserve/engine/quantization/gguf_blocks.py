"""Vectorized torch dequantizers for GGML blocks (llama.cpp's ``ggml-quants`` formats).

Each takes ``blocks [num_blocks, block_bytes]`` uint8 and returns ``[num_blocks,
block_values]`` float32. Layouts (little-endian; ``d``/``m``/``dmin`` are float16)::

    Q8_0  34 B / 32 values:  d | qs int8[32]                 w = d * q
    Q4_0  18 B / 32 values:  d | qs[16]                      w = d * (q - 8)
    Q4_1  20 B / 32 values:  d | m | qs[16]                  w = d * q + m
          (value j < 16 is the low nibble of qs[j], value j + 16 its high nibble)
    Q4_K 144 B / 256 values: d | dmin | scales[12] | qs[128]
          8 sub-blocks of 32 with 6-bit scale sc and min mn; w = d*sc*q - dmin*mn;
          qs[32c : 32c+32] holds sub-block 2c (low nibbles) and 2c+1 (high nibbles)
    Q6_K 210 B / 256 values: ql[128] | qh[64] | scales int8[16] | d
          q = (4 low bits from ql | 2 high bits from qh) - 32, w = d * scale[16 groups] * q
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import gguf
import torch

T = gguf.GGMLQuantizationType


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """``[num_blocks, 1]`` float32 of the float16 at byte ``start`` of each block."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes -> ``[n, 32]``: low nibbles then high nibbles."""
    return torch.cat((qs & 0xF, qs >> 4), dim=1)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 ``blocks [n, 34]`` uint8 -> ``[n, 32]`` fp32: ``w = d * q``, q int8."""
    return _f16(blocks, 0) * blocks[:, 2:34].contiguous().view(torch.int8).float()


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 ``blocks [n, 18]`` uint8 -> ``[n, 32]`` fp32: ``w = d * (q - 8)``, q in 0..15."""
    return _f16(blocks, 0) * (_nibbles_32(blocks[:, 2:18]).float() - 8.0)


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 ``blocks [n, 20]`` uint8 -> ``[n, 32]`` fp32: ``w = d * q + m``, q in 0..15."""
    return _f16(blocks, 0) * _nibbles_32(blocks[:, 4:20]).float() + _f16(blocks, 2)


def q4_blocks_as_int4(ggml_type: T, packed: torch.Tensor, num_cols: int,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1 rows as 4-bit codes with per-block scale and offset, ``w = (q - 8) * scale
    + offset`` (Q4_0: ``offset = 0``; Q4_1, ``w = d q + m``: ``offset = m + 8 d``).

    Args:
        packed: ``[rows, num_cols / 32 * block_bytes]`` uint8 blocks.

    Returns:
        ``(codes [rows, num_cols] uint8 in 0..15, scales [rows, num_cols / 32] float32,
        offsets [rows, num_cols / 32] float32)``.
    """
    rows = packed.shape[0]
    blocks = packed.reshape(-1, 18 if ggml_type == T.Q4_0 else 20)
    d = _f16(blocks, 0)  # [rows * num_blocks, 1]
    if ggml_type == T.Q4_0:
        codes, offsets = _nibbles_32(blocks[:, 2:18]), torch.zeros_like(d)
    elif ggml_type == T.Q4_1:
        codes, offsets = _nibbles_32(blocks[:, 4:20]), _f16(blocks, 2) + 8.0 * d
    else:
        raise ValueError(f"q4_blocks_as_int4 takes Q4_0/Q4_1 blocks, got {ggml_type.name}")
    return codes.reshape(rows, num_cols), d.reshape(rows, -1), offsets.reshape(rows, -1)


def _k4_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K's 12 scale bytes into 8 six-bit scales and 8 six-bit mins, ``[n, 8]`` each."""
    s = s.to(torch.int32)
    lo_sc, lo_mn, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo_sc & 63, (hi & 0xF) | ((lo_sc >> 6) << 4)), dim=1)
    mn = torch.cat((lo_mn & 63, (hi >> 4) | ((lo_mn >> 6) << 4)), dim=1)
    return sc.float(), mn.float()


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K ``blocks [n, 144]`` uint8 -> ``[n, 256]`` fp32: 8 sub-blocks of 32 values,
    ``w = d * sc * q - dmin * mn`` with each sub-block's 6-bit scale ``sc`` and min ``mn``."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k4_scales_mins(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(n, 4, 32)
    q = torch.stack((qs & 0xF, qs >> 4), dim=2).reshape(n, 8, 32).float()  # sub-block order
    return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(n, 256)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K ``blocks [n, 210]`` uint8 -> ``[n, 256]`` fp32: ``w = d * scale * (q - 32)``,
    q six bits (``ql`` low four, ``qh`` high two), one int8 scale per 16 values."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(blocks, 208)
    low = torch.stack((ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4,
                       ql[..., 32:] >> 4), dim=2)  # [n, 2, 4, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
    high = (qh >> shifts[None, None, :, None]) & 3  # [n, 2, 4, 32]
    q = (low | (high << 4)).float() - 32.0
    # value l of quarter j in half h uses scale index 8h + 2j + l // 16
    s = scales.reshape(n, 2, 4, 2)[..., None].expand(n, 2, 4, 2, 16).reshape(n, 2, 4, 32)
    return (d[:, :, None, None] * s * q).reshape(n, 256)


#: GGML type -> (block dequantizer, values per block, bytes per block). Read-only.
BLOCK_DEQUANTIZERS: MappingProxyType[T, tuple[Callable[[torch.Tensor], torch.Tensor], int, int]] = (
    MappingProxyType({
        T.Q8_0: (dequantize_q8_0, 32, 34),
        T.Q4_0: (dequantize_q4_0, 32, 18),
        T.Q4_1: (dequantize_q4_1, 32, 20),
        T.Q4_K: (dequantize_q4_k, 256, 144),
        T.Q6_K: (dequantize_q6_k, 256, 210),
    }))


def dequantize_rows(ggml_type: T, packed: torch.Tensor) -> torch.Tensor:
    """``packed [rows, row_bytes]`` uint8 blocks of ``ggml_type`` -> ``[rows, row_values]`` fp32.

    Raises:
        ValueError: ``ggml_type`` is not one of :data:`BLOCK_DEQUANTIZERS`.
    """
    if ggml_type not in BLOCK_DEQUANTIZERS:
        raise ValueError(f"GGML type {ggml_type.name} cannot stay packed "
                         f"(supported: {', '.join(t.name for t in BLOCK_DEQUANTIZERS)})")
    fn, values, nbytes = BLOCK_DEQUANTIZERS[ggml_type]
    rows = packed.shape[0]
    return fn(packed.reshape(-1, nbytes)).reshape(rows, -1)
