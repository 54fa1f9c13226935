"""``--quantization awq``: AutoAWQ GEMM checkpoints (``qweight``/``qzeros``/``scales``)."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.engine.quantization.int_layouts import unpack_awq
from pdserve.engine.quantization.int_linear import IntLinear
from pdserve.engine.quantization.int_weight import cat_rows
from pdserve.engine.quantization.methods.common import iter_stored_tensors
from pdserve.engine.quantization.registry import LayerSpec, Shards, register


@register("awq")
class AwqMethod:
    """Loads 4-bit AutoAWQ ``version: gemm`` weights into :class:`IntLinear`.

    Raises:
        ValueError: bits other than 4, or a ``version`` other than ``gemm``.
    """

    name = "awq"
    quantizes_dense = False

    def __init__(self, hf_config: dict[str, Any]) -> None:
        qc = hf_config.get("quantization_config", {})
        self.group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ValueError(f"AWQ checkpoints must be 4-bit 'gemm', got bits={bits}, "
                             f"version={version!r}")

    iter_tensors = staticmethod(iter_stored_tensors)

    def is_complete(self, shard: dict[str, Any]) -> bool:
        """A shard needs ``qweight``, ``qzeros`` (int32 packs) and ``scales`` (fp16)."""
        return {"qweight", "qzeros", "scales"} <= shard.keys()

    def build(self, spec: LayerSpec, shards: Shards,
              bias: torch.Tensor | None) -> IntLinear | None:
        """An :class:`IntLinear` of the shards' unpacked 4-bit weights, stacked in row order;
        None when a shard lacks the AWQ tensors (a layer stored dense)."""
        if not all(self.is_complete(s) for s in shards):
            return None
        parts = [unpack_awq(s["qweight"], s["qzeros"], s["scales"], self.group_size)
                 for s in shards]
        return IntLinear(cat_rows(parts), bias, spec.gemm_dtype)
