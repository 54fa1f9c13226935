"""``--quantization fp8``: dynamic FP8 e4m3 weights, per-output-channel scales."""

from __future__ import annotations

import torch

from pdserve.engine.quantization.fp8_linear import Fp8Linear
from pdserve.engine.quantization.methods.common import DenseQuantizingMethod, dense_weight
from pdserve.engine.quantization.registry import LayerSpec, Shards, register


@register("fp8")
class Fp8Method(DenseQuantizingMethod):
    """Quantizes each dense linear weight to FP8 at load (:class:`Fp8Linear`)."""

    name = "fp8"

    def build(self, spec: LayerSpec, shards: Shards, bias: torch.Tensor | None) -> Fp8Linear:
        """An :class:`Fp8Linear` of the shards' dense weights stacked, ``[sum(rows), in]``."""
        return Fp8Linear(dense_weight(shards), bias, spec.gemm_dtype)
