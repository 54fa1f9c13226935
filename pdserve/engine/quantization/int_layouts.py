"""Packed int4/int8 checkpoint layouts and their conversion to/from :class:`IntWeight`.

All three pack integer codes into int32 words, low bits first, ``32 // bits`` codes a word;
they differ in which dimension is packed and in small offsets. For a linear ``W [out, in]``
with ``G = ceil(in / group_size)`` groups::

    AutoAWQ GEMM (Lin et al. 2023)     qweight [in, out/8] int32   packed along out, nibble
                                       qzeros  [G, out/8]  int32   order 0 2 4 6 1 3 5 7
                                       scales  [G, out]    fp16
    GPTQ v1 (Frantar et al. 2023)      qweight [in/8, out] int32   packed along in
                                       qzeros  [G, out/8]  int32   stores zero - 1 (v1 offset;
                                       scales  [G, out]    fp16    gptq_v2 stores zero)
                                       g_idx   [in]        int32   group of each column
    compressed-tensors pack-quantized  weight_packed [out, in/8] int32  packed along in,
      (llm-compressor, W4A16/W8A16)    weight_scale  [out, G]           codes stored as
                                       weight_zero_point [out/8, G]     signed + 2**(bits-1)
                                       weight_shape  [2] int64          (zero point packed
                                                                        along out)
"""

from __future__ import annotations

import torch

from pdserve.engine.quantization.int_weight import IntWeight

#: AutoAWQ's nibble order: physical nibble ``i`` of a word holds logical column ``AWQ_ORDER[i]``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[rows, n]`` unsigned codes (< 2**bits) along the last dim, low bits first.

    Returns ``[rows, ceil(n * bits / 32)]`` int32 (the last word zero-padded).
    """
    per_word = 32 // bits
    rows, n = values.shape
    pad = (-n) % per_word
    v = torch.nn.functional.pad(values.to(torch.int64), (0, pad))
    v = v.view(rows, -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device) * bits
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_int32(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: ``[rows, words] int32 -> [rows, n]`` uint8 codes."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=words.device) * bits
    v = (words[..., None] >> shifts) & (2**bits - 1)
    return v.reshape(words.shape[0], -1)[:, :n].to(torch.uint8)


def _awq_permute(codes: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    rows, n = codes.shape
    return codes.view(rows, n // 8, 8)[..., list(order)].reshape(rows, n)


_AWQ_INVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))


def _require_integer_zeros(w: IntWeight) -> None:
    """Packed layouts store integer zero points; the float "min" form has no packing."""
    if w.zeros.is_floating_point():
        raise ValueError("this layout stores integer zero points; quantize without "
                         "float_zeros to write it")


def pack_awq(w: IntWeight) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors (``qweight``, ``qzeros``, ``scales``) of a 4-bit weight.

    Raises:
        ValueError: not 4 bits, act-order ``g_idx`` present, or ``out`` not a multiple of 8.
    """
    _require_integer_zeros(w)
    if w.bits != 4 or w.g_idx is not None or w.shape[0] % 8:
        raise ValueError("the AWQ layout holds 4-bit weights without g_idx, out % 8 == 0")
    return {
        "qweight": pack_int32(_awq_permute(w.codes.t().contiguous(), AWQ_ORDER), 4),
        "qzeros": pack_int32(_awq_permute(w.zeros.t().contiguous(), AWQ_ORDER), 4),
        "scales": w.scales.t().contiguous().half(),
    }


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> IntWeight:
    """:class:`IntWeight` of AutoAWQ GEMM tensors (shapes in the module docstring)."""
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    codes = _awq_permute(unpack_int32(qweight, 4, out_features), _AWQ_INVERSE)
    zeros = _awq_permute(unpack_int32(qzeros, 4, out_features), _AWQ_INVERSE)
    gs = in_features if group_size == -1 else group_size
    return IntWeight(codes.t().contiguous(), scales.t().half().contiguous(),
                     zeros.t().contiguous(), 4, gs)


def pack_gptq(w: IntWeight, v1_zero_offset: bool = True) -> dict[str, torch.Tensor]:
    """GPTQ tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``); v1 stores ``zero - 1``."""
    _require_integer_zeros(w)
    zeros = w.zeros.to(torch.int64) - (1 if v1_zero_offset else 0)
    zeros = zeros & (2**w.bits - 1)
    return {
        "qweight": pack_int32(w.codes, w.bits).t().contiguous(),
        "qzeros": pack_int32(zeros.t().contiguous(), w.bits),
        "scales": w.scales.t().contiguous().half(),
        "g_idx": w.group_index().to(torch.int32),
    }


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, bits: int, group_size: int,
                v1_zero_offset: bool = True) -> IntWeight:
    """:class:`IntWeight` of GPTQ tensors; ``g_idx`` kept only when it is not ``i // group``.

    With ``v1_zero_offset`` the stored zero is read as ``stored + 1`` (so a stored 15 reads
    as 16, as in the historical v1 kernels).
    """
    out_features = qweight.shape[1]
    in_features = qweight.shape[0] * 32 // bits
    codes = unpack_int32(qweight.t().contiguous(), bits, in_features)  # [out, in]
    zeros = unpack_int32(qzeros, bits, out_features).t().contiguous()  # [out, G]
    if v1_zero_offset:
        zeros = zeros + 1
    gs = in_features if group_size == -1 else group_size
    if g_idx is not None:
        default = torch.arange(in_features, device=g_idx.device) // gs
        if torch.equal(g_idx.long(), default):
            g_idx = None
    return IntWeight(codes, scales.t().half().contiguous(), zeros, bits, gs,
                     None if g_idx is None else g_idx.to(torch.int32))


def pack_compressed_tensors(w: IntWeight, symmetric: bool = False) -> dict[str, torch.Tensor]:
    """compressed-tensors ``pack-quantized`` tensors of ``w`` (``weight_*`` names)."""
    _require_integer_zeros(w)
    out = {
        "weight_packed": pack_int32(w.codes, w.bits),
        "weight_scale": w.scales.half().contiguous(),
        "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }
    if not symmetric:
        out["weight_zero_point"] = pack_int32(w.zeros.t().contiguous(), w.bits).t().contiguous()
    if w.g_idx is not None:
        out["weight_g_idx"] = w.g_idx.to(torch.int32)
    return out


def unpack_compressed_tensors(tensors: dict[str, torch.Tensor], bits: int,
                              group_size: int) -> IntWeight:
    """:class:`IntWeight` of compressed-tensors ``pack-quantized`` tensors.

    ``weight_zero_point`` may be packed along ``out`` (current writers), an unpacked signed
    ``[out, G]`` tensor (older ones) or absent (symmetric: zero ``2**(bits-1)``).
    """
    out_features, in_features = (int(v) for v in tensors["weight_shape"].tolist())
    codes = unpack_int32(tensors["weight_packed"], bits, in_features)
    scales = tensors["weight_scale"].half()
    if scales.dim() == 1:
        scales = scales[:, None]
    offset = 2 ** (bits - 1)
    zp = tensors.get("weight_zero_point")
    if zp is None:
        zeros = torch.full(scales.shape, offset, dtype=torch.uint8)
    elif zp.dtype == torch.int32 and zp.shape[0] != out_features:
        zeros = unpack_int32(zp.t().contiguous(), bits, out_features).t().contiguous()
    else:
        zeros = (zp.reshape(scales.shape).to(torch.int16) + offset).to(torch.uint8)
    gs = in_features if group_size in (-1, None) else group_size
    g_idx = tensors.get("weight_g_idx")
    return IntWeight(codes, scales.contiguous(), zeros, bits, gs,
                     None if g_idx is None else g_idx.to(torch.int32))
