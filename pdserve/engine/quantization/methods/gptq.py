"""``--quantization gptq``: GPTQ checkpoints (exllama v1 layout, or ``gptq_v2``)."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.engine.quantization.int_layouts import unpack_gptq
from pdserve.engine.quantization.int_linear import IntLinear
from pdserve.engine.quantization.int_weight import cat_rows
from pdserve.engine.quantization.methods.common import iter_stored_tensors
from pdserve.engine.quantization.registry import LayerSpec, Shards, register


@register("gptq")
class GptqMethod:
    """Loads 4/8-bit GPTQ weights, act-order ``g_idx`` included, into :class:`IntLinear`.

    ``checkpoint_format: gptq`` (default) stores zeros minus one; ``gptq_v2`` stores them as is.

    Raises:
        ValueError: bits other than 4 or 8.
    """

    name = "gptq"
    quantizes_dense = False

    def __init__(self, hf_config: dict[str, Any]) -> None:
        qc = hf_config.get("quantization_config", {})
        self.bits = int(qc.get("bits", 4))
        self.group_size = int(qc.get("group_size", 128))
        self.v1_zero_offset = qc.get("checkpoint_format", "gptq") != "gptq_v2"
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoints must be 4 or 8 bits, got {self.bits}")

    iter_tensors = staticmethod(iter_stored_tensors)

    def is_complete(self, shard: dict[str, Any]) -> bool:
        """A shard needs ``qweight``, ``qzeros``, ``scales`` and ``g_idx`` (a layer stored
        without ``g_idx`` is built once the checkpoint ends)."""
        return {"qweight", "qzeros", "scales", "g_idx"} <= shard.keys()

    def build(self, spec: LayerSpec, shards: Shards,
              bias: torch.Tensor | None) -> IntLinear | None:
        """An :class:`IntLinear` of the shards' unpacked weights (with ``g_idx`` where stored),
        stacked in row order; None when a shard lacks ``qweight``/``qzeros``/``scales``."""
        if not all({"qweight", "qzeros", "scales"} <= s.keys() for s in shards):
            return None
        parts = [unpack_gptq(s["qweight"], s["qzeros"], s["scales"], s.get("g_idx"), self.bits,
                             self.group_size, self.v1_zero_offset) for s in shards]
        return IntLinear(cat_rows(parts), bias, spec.gemm_dtype)
