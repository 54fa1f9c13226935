"""``--quantization fp8``: dynamic FP8 e4m3 weights, per-output-channel scales."""

from __future__ import annotations

from pdserve.engine.quantization.fp8_linear import Fp8Linear
from pdserve.engine.quantization.methods.common import DenseQuantizingMethod, dense_weight
from pdserve.engine.quantization.registry import register


@register("fp8")
class Fp8Method(DenseQuantizingMethod):
    """Quantizes each dense linear weight to FP8 at load (:class:`Fp8Linear`)."""

    name = "fp8"

    def build(self, spec, shards, bias):
        return Fp8Linear(dense_weight(shards), bias, spec.gemm_dtype)
