"""``IntLinear``: a linear layer whose weight stays group-quantized int4/int8 (W4A16/W8A16)."""

from __future__ import annotations

import torch

from pdserve.engine.quantization.base import DEFAULT_MAX_SCRATCH_ELEMS, QuantizedLinear
from pdserve.engine.quantization.cpu_packed import Int4CpuGemm, Int8CpuGemm, int4_layout_fits
from pdserve.engine.quantization.int_weight import IntWeight


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, in]`` uint8 codes in 0..15 -> ``[rows, in / 2]`` uint8 (even column low nibble)."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[rows, in / 2]`` -> ``[rows, in]`` uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


class IntLinear(QuantizedLinear):
    """Weight-only group-quantized linear layer (AWQ, GPTQ, compressed-tensors, RTN).

    Buffers::

        qweight  [out, in/2] uint8 (4 bits, two codes a byte) or [out, in] uint8 (8 bits)
        scales   [out, num_groups] float16
        zeros    [out, num_groups] uint8, or float16 for the float "min" form (rtn-*)
        g_idx    [in] int32, only for act-order checkpoints

    On CUDA with Triton the forward pass runs the fused W4A16 kernel of
    :mod:`pdserve.engine.quantization.kernels.w4a16`; on CPU with bf16/fp16 activations,
    torch's packed int4/int8 kernels (:meth:`build_cpu_gemms`); elsewhere it dequantizes
    slabs (see :class:`~.base.QuantizedLinear`).

    Args:
        weight: the unpacked weight (any device; buffers follow it).
        bias: ``[out]`` or None.
        gemm_dtype: dtype of the dequantized slab and of the GEMM.
    """

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None, gemm_dtype: torch.dtype,
                 max_scratch_elems: int = DEFAULT_MAX_SCRATCH_ELEMS) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias, gemm_dtype, max_scratch_elems)
        self.bits = weight.bits
        self.group_size = weight.group_size
        codes = weight.codes
        self.register_buffer("qweight", pack_nibbles(codes) if self.bits == 4
                             else codes.to(torch.uint8).contiguous())
        self.register_buffer("scales", weight.scales.to(torch.float16).contiguous())
        zeros = weight.zeros if weight.zeros.dtype == torch.float16 else weight.zeros.to(torch.uint8)
        self.register_buffer("zeros", zeros.contiguous())
        self.register_buffer("g_idx", None if weight.g_idx is None
                             else weight.g_idx.to(torch.int32).contiguous())

    def int_weight(self) -> IntWeight:
        """The unpacked weight (a copy of the codes)."""
        codes = unpack_nibbles(self.qweight) if self.bits == 4 else self.qweight.clone()
        return IntWeight(codes, self.scales, self.zeros, self.bits, self.group_size, self.g_idx)

    def dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """``(q - z) * s`` of rows ``start:end``: ``[end - start, in_features]`` in ``dtype``
        (computed in fp32, in place by group; by ``g_idx`` for act-order weights: a gather
        of every column's scale and zero, 16x slower)."""
        packed = self.qweight[start:end]
        codes = unpack_nibbles(packed) if self.bits == 4 else packed
        rows = end - start
        s = self.scales[start:end].float()
        z = self.zeros[start:end].float()
        if self.g_idx is None:  # whole groups, then a shorter last one (576 = 4.5 x 128)
            w = codes.float()
            g = self.group_size
            full = self.in_features // g  # whole groups
            w[:, :full * g].view(rows, full, g).sub_(z[:, :full, None]).mul_(s[:, :full, None])
            if full * g < self.in_features:
                w[:, full * g:].sub_(z[:, full:full + 1]).mul_(s[:, full:full + 1])
            return w.to(dtype)
        gi = self.g_idx.long()
        return ((codes.float() - z[:, gi]) * s[:, gi]).to(dtype)

    def build_cpu_gemms(self, dtype: torch.dtype) -> list:
        """int4 in a layout the CPU int4 kernel takes (no ``g_idx``, ``in`` a multiple of a
        group size it supports): exact, ``offset = (8 - z) * s``; anything else: per-channel
        int8 of the dequantized weight (see :mod:`.cpu_packed`)."""
        if (self.bits == 4 and self.g_idx is None
                and int4_layout_fits(self.out_features, self.in_features, self.group_size)):
            s = self.scales.float()
            offsets = (8.0 - self.zeros.float()) * s
            return [Int4CpuGemm(unpack_nibbles(self.qweight), s, offsets, self.group_size,
                                dtype)]
        return [Int8CpuGemm(self.dequantize(torch.float32), dtype)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features] -> [..., out_features]`` in ``x.dtype``.

        On CUDA with Triton, 4-bit weights without ``g_idx`` run the fused W4A16 kernel;
        everything else goes through :meth:`QuantizedLinear.forward`.
        """
        if x.is_cuda and self.bits == 4 and self.g_idx is None:
            from pdserve.engine.quantization.kernels import w4a16

            if w4a16.is_available():
                y = w4a16.w4a16_linear(x.reshape(-1, self.in_features), self.qweight,
                                       self.scales, self.zeros, self.group_size)
                y = y.reshape(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias.to(y.dtype)
        return super().forward(x)

    def extra_repr(self) -> str:
        """The base fields plus bit width and group size."""
        return f"{super().extra_repr()}, bits={self.bits}, group_size={self.group_size}"
