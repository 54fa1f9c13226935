"""``GGUFLinear``: a linear layer whose weight stays in GGML blocks (Q4_0/Q4_1/Q8_0/Q4_K/Q6_K)."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from pdserve.engine.quantization.base import DEFAULT_MAX_SCRATCH_ELEMS, QuantizedLinear
from pdserve.engine.quantization.cpu_packed import Int4CpuGemm, Int8CpuGemm, int4_layout_fits
from pdserve.engine.quantization.gguf_blocks import (
    BLOCK_DEQUANTIZERS,
    dequantize_rows,
    q4_blocks_as_int4,
)


@dataclass
class GGUFPackedWeight:
    """One GGUF weight, still packed.

    Attributes:
        ggml_type: the block format.
        data: ``[rows, row_bytes]`` uint8 blocks (rows = output features) for a packed type,
            or a float ``[rows, cols]`` tensor for F32/F16/BF16.
        num_cols: logical input features.
    """

    ggml_type: gguf.GGMLQuantizationType
    data: torch.Tensor
    num_cols: int

    @property
    def is_packed(self) -> bool:
        """Whether ``data`` is GGML blocks (a type in ``BLOCK_DEQUANTIZERS``), not floats."""
        return self.ggml_type in BLOCK_DEQUANTIZERS

    def dequantize(self) -> torch.Tensor:
        """``[rows, num_cols]`` float32."""
        if self.is_packed:
            return dequantize_rows(self.ggml_type, self.data)
        return self.data.float()


class GGUFLinear(QuantizedLinear):
    """Linear layer over row segments of GGML blocks (fused q/k/v or gate/up may mix types).

    Buffers ``packed_i``: ``[rows_i, row_bytes_i]`` uint8, segment ``i`` of the output rows.
    On CUDA with Triton, Q4_0/Q4_1/Q8_0 segments run the fused dequant-GEMM of
    :mod:`pdserve.engine.quantization.kernels.gguf_gemm`.

    Args:
        parts: the segments, in output-row order, all with the same ``num_cols``.
        bias: ``[out]`` or None.
        gemm_dtype: dtype of the dequantized slab and of the GEMM.

    Raises:
        ValueError: a part is not a packed GGML type, or the parts differ in ``num_cols``.
    """

    def __init__(self, parts: list[GGUFPackedWeight], bias: torch.Tensor | None,
                 gemm_dtype: torch.dtype,
                 max_scratch_elems: int = DEFAULT_MAX_SCRATCH_ELEMS) -> None:
        in_features = parts[0].num_cols
        if any(p.num_cols != in_features for p in parts) or not all(p.is_packed for p in parts):
            raise ValueError("GGUFLinear needs packed parts with one input size")
        super().__init__(in_features, sum(p.data.shape[0] for p in parts), bias, gemm_dtype,
                         max_scratch_elems)
        self.ggml_types = [p.ggml_type for p in parts]
        self.row_starts = [0]
        for i, p in enumerate(parts):
            self.register_buffer(f"packed_{i}", p.data.contiguous())
            self.row_starts.append(self.row_starts[-1] + p.data.shape[0])

    def segments(self) -> list[tuple[gguf.GGMLQuantizationType, int, torch.Tensor]]:
        """``(ggml_type, first_row, packed)`` for each segment."""
        return [(t, self.row_starts[i], getattr(self, f"packed_{i}"))
                for i, t in enumerate(self.ggml_types)]

    def dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``start:end`` of the segments' blocks, ``[end - start, in_features]`` in
        ``dtype`` (dequantized in fp32, segment by segment)."""
        pieces = []
        for ggml_type, first, packed in self.segments():
            lo, hi = max(start, first), min(end, first + packed.shape[0])
            if lo < hi:
                pieces.append(dequantize_rows(ggml_type, packed[lo - first:hi - first]))
        w = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return w.to(dtype)

    def build_cpu_gemms(self, dtype: torch.dtype) -> list:
        """Per segment: Q4_0/Q4_1 as packed int4 (exact: scale ``d``, offset ``0`` or
        ``m + 8 d``); other types as per-channel int8 of the dequantized rows."""
        gemms = []
        for ggml_type, _, packed in self.segments():
            rows = packed.shape[0]
            if (ggml_type in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
                    and int4_layout_fits(rows, self.in_features, 32)):
                codes, scales, offsets = q4_blocks_as_int4(ggml_type, packed, self.in_features)
                gemms.append(Int4CpuGemm(codes, scales, offsets, 32, dtype))
            else:
                gemms.append(Int8CpuGemm(dequantize_rows(ggml_type, packed), dtype))
        return gemms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features] -> [..., out_features]`` in ``x.dtype``.

        On CUDA, when Triton is available and every segment is Q4_0/Q4_1/Q8_0, each segment
        runs the fused dequant-GEMM and the outputs are joined; otherwise
        :meth:`QuantizedLinear.forward` (packed CPU GEMMs or dequantized slabs).
        """
        if x.is_cuda:
            from pdserve.engine.quantization.kernels import gguf_gemm

            if gguf_gemm.is_available() and all(t in gguf_gemm.SUPPORTED_TYPES
                                                for t in self.ggml_types):
                x2 = x.reshape(-1, self.in_features)
                y = torch.cat([gguf_gemm.gguf_linear(x2, packed, t)
                               for t, _, packed in self.segments()], dim=-1)
                y = y.reshape(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias.to(y.dtype)
        return super().forward(x)

    def extra_repr(self) -> str:
        """The base fields plus the segments' GGML types, in row order."""
        types = ",".join(t.name for t in self.ggml_types)
        return f"{super().extra_repr()}, types={types}"
