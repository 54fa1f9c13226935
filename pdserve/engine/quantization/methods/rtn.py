"""``--quantization rtn-int4|rtn-int8``: round-to-nearest group quantization at load."""

from __future__ import annotations

from pdserve.engine.quantization.int_linear import IntLinear
from pdserve.engine.quantization.int_weight import quantize_rtn
from pdserve.engine.quantization.methods.common import DenseQuantizingMethod, dense_weight
from pdserve.engine.quantization.registry import register

#: Group size of load-time RTN (input columns per fp16 scale and uint8 zero).
RTN_GROUP_SIZE = 64


class RtnMethod(DenseQuantizingMethod):
    """Asymmetric RTN with one scale and zero per :data:`RTN_GROUP_SIZE` input columns."""

    bits = 4

    def build(self, spec, shards, bias):
        weight = quantize_rtn(dense_weight(shards), self.bits, RTN_GROUP_SIZE)
        return IntLinear(weight, bias, spec.gemm_dtype)


@register("rtn-int4")
class RtnInt4Method(RtnMethod):
    name = "rtn-int4"
    bits = 4


@register("rtn-int8")
class RtnInt8Method(RtnMethod):
    name = "rtn-int8"
    bits = 8
