"""Weight-only int4/int8 GEMMs on CPU through torch's packed kernels (no dequantized slab).

A decode step multiplies each weight by a few rows, so it is bound by reading the weights:
int4 weights are a quarter of bf16's bytes, int8 half. Dequantizing a slab before a dense
GEMM (:class:`~.base.QuantizedLinear`'s generic path) throws that away, it writes and reads
a full-precision copy per call. These wrap torch's maintained CPU kernels instead, which
unpack inside the GEMM's inner loop:

- :class:`Int4CpuGemm`: ``aten._weight_int4pack_mm_for_cpu`` (the "tinygemm" layout torchao's
  ``Int4WeightOnlyConfig`` uses on CPU). Groups of 32/64/128/256 input columns, each with a
  scale and an offset, ``w = (q - 8) * scale + offset``, q in 0..15. Integer zero points
  (AWQ/GPTQ/compressed-tensors, ``w = (q - z) * s``) map exactly onto it with
  ``offset = (8 - z) * s``, and so do GGML's Q4_0 (``offset = 0``) and Q4_1
  (``w = d q + m``: ``offset = m + 8 d``). Scales and offsets are held in the activation
  dtype (bf16), as the kernel requires: a relative rounding of at most 2^-9 on each
  group's fp16 scale, far under a 4-bit step.
- :class:`Int8CpuGemm`: ``aten._weight_int8pack_mm``: per-output-channel symmetric int8,
  ``w = q * scale``. Group-wise int8 formats (rtn-int8's groups of 128, GGML Q8_0's blocks
  of 32, Q4_K/Q6_K) are dequantized once at load and requantized per channel for it; the
  extra rounding is half a step of ``max|w_row| / 127``.

Both take bf16 (or fp16) activations; torch's fp32 path of these kernels is 10-30x slower
than an fp32 dense GEMM on the AVX2 CPUs measured here, so fp32 models keep the slab path.
Measured on a 2-core AMD EPYC (AVX2, no AVX512), one SmolLM2 layer's four GEMMs, 1 row:
fp32 dense 1.31 ms, int8 0.56 ms, int4 0.41 ms; 32 rows: 3.43 / 4.79 / 5.63 ms.
"""

from __future__ import annotations

import torch

#: Group sizes the int4 CPU kernel takes.
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: Activation dtypes the packed kernels run fast on.
PACKED_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
#: The int4 packer interleaves output channels in tiles of this many rows.
_INT4_ROW_TILE = 16


def int4_layout_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether :class:`Int4CpuGemm` can hold a weight of this shape and grouping."""
    return (group_size in INT4_GROUP_SIZES and in_features % group_size == 0
            and out_features % _INT4_ROW_TILE == 0)


class Int4CpuGemm:
    """``y = x @ W^T`` with ``W [out, in]`` as packed int4 codes and per-group scale/offset.

    Args:
        codes: ``[out, in]`` integer codes in 0..15 (any integer dtype).
        scales: ``[out, in / group_size]`` float.
        offsets: ``[out, in / group_size]`` float: ``w = (q - 8) * scale + offset``.
        group_size: one of :data:`INT4_GROUP_SIZES`, dividing ``in``.
        dtype: activation dtype the layer will be called with (bf16 or fp16).

    Raises:
        ValueError: a shape or group size the kernel does not take
            (:func:`int4_layout_fits`).
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 group_size: int, dtype: torch.dtype = torch.bfloat16) -> None:
        out_features, in_features = codes.shape
        if not int4_layout_fits(out_features, in_features, group_size):
            raise ValueError(f"int4 CPU packing needs out % {_INT4_ROW_TILE} == 0 and a group "
                             f"size in {INT4_GROUP_SIZES} dividing in_features; got "
                             f"[{out_features}, {in_features}] in groups of {group_size}")
        self.group_size = group_size
        self.out_features = out_features
        # [out, in / 2] uint8, tile-interleaved by torch's packer
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1)
        # [in / group_size, out, 2] (scale, offset) in the activation dtype
        self.scales_and_offsets = torch.stack(
            (scales.float().t(), offsets.float().t()), dim=-1).to(dtype).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes (``out * in / 2``) plus the scale/offset pairs."""
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_and_offsets.numel() * self.scales_and_offsets.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, in] bf16/fp16 -> [num_tokens, out]`` in ``x.dtype``."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_offsets.to(x.dtype))


class Int8CpuGemm:
    """``y = x @ W^T`` with ``W`` as per-output-channel symmetric int8 (``w = q * scale``).

    Args:
        weight: ``[out, in]`` float, the logical weight (quantized here: ``scale =
            max|w_row| / 127`` rounded up to ``dtype``, ``q = round(w / scale)``).
        dtype: activation dtype the layer will be called with (bf16 or fp16).
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> None:
        w = weight.float()
        # The kernel takes scales in the activation dtype: round them first (up by 2^-8 so
        # the largest weight still fits in 127 after the 2^-9 rounding) and quantize with
        # the rounded value, so the only error is the code's own rounding.
        scale = (w.abs().amax(dim=1) / 127.0 * (1 + 2**-8)).clamp(min=1e-30).to(dtype)
        self.qweight = (w / scale.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        self.scales = scale  # [out]
        self.out_features = w.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held: int8 codes (``out * in``) plus one scale per output channel."""
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, in] bf16/fp16 -> [num_tokens, out]`` in ``x.dtype``."""
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales.to(x.dtype))


def packed_cpu_forward(gemms: list, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """Run row segments' packed GEMMs on ``x [..., in]`` and join their outputs
    ``[..., out_features]`` (one GEMM: no copy)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = gemms[0](x2) if len(gemms) == 1 else torch.cat([g(x2) for g in gemms], dim=-1)
    return y.reshape(*x.shape[:-1], out_features)
