"""``--quantization rtn-int4|rtn-int8``: round-to-nearest group quantization at load."""

from __future__ import annotations

import torch

from pdserve.engine.quantization.int_linear import IntLinear
from pdserve.engine.quantization.int_weight import quantize_rtn
from pdserve.engine.quantization.methods.common import DenseQuantizingMethod, dense_weight
from pdserve.engine.quantization.registry import LayerSpec, Shards, register


class RtnMethod(DenseQuantizingMethod):
    """Asymmetric RTN with one fp16 scale and one fp16 zero point per ``group_size`` columns.

    Without calibration, small groups and exact group minima are what hold int4 quality:
    rtn-int4 uses groups of 32 (llama.cpp's Q4_1 block; 0.31x the bf16 bytes) in the float
    "min" form (:func:`quantize_rtn` ``float_zeros``), rtn-int8 groups of 128. For int4 at
    group 128, or a checkpoint other engines load, write one with ``pdserve quantize``.
    """

    bits = 4
    group_size = 32

    def build(self, spec: LayerSpec, shards: Shards, bias: torch.Tensor | None) -> IntLinear:
        """An :class:`IntLinear` of the shards' dense weights stacked and RTN-quantized to
        ``bits`` in groups of ``group_size`` (fp16 scale and fp16 zero point per group)."""
        weight = quantize_rtn(dense_weight(shards), self.bits, self.group_size,
                              float_zeros=True)
        return IntLinear(weight, bias, spec.gemm_dtype)


@register("rtn-int4")
class RtnInt4Method(RtnMethod):
    """``rtn-int4``: 4-bit codes in groups of 32 input columns."""

    name = "rtn-int4"
    bits = 4
    group_size = 32


@register("rtn-int8")
class RtnInt8Method(RtnMethod):
    """``rtn-int8``: 8-bit codes in groups of 128 input columns."""

    name = "rtn-int8"
    bits = 8
    group_size = 128
