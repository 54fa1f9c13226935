"""``--quantization compressed-tensors``: llm-compressor's ``pack-quantized`` W4A16/W8A16."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.engine.quantization.int_layouts import unpack_compressed_tensors
from pdserve.engine.quantization.int_linear import IntLinear
from pdserve.engine.quantization.int_weight import cat_rows
from pdserve.engine.quantization.methods.common import iter_stored_tensors
from pdserve.engine.quantization.registry import LayerSpec, Shards, register


def weight_scheme(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The ``weights`` args of the (single) config group of a compressed-tensors config.

    Raises:
        ValueError: no config group, several different weight schemes, or activation
            quantization (only weight-only schemes are supported).
    """
    groups = hf_config.get("quantization_config", {}).get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values()]
    if not schemes or any(s != schemes[0] for s in schemes) or schemes[0] is None:
        raise ValueError("compressed-tensors: expected one weight-only quantization scheme")
    if any(g.get("input_activations") for g in groups.values()):
        raise ValueError("compressed-tensors: activation quantization is not supported")
    return schemes[0]


@register("compressed-tensors")
class CompressedTensorsMethod:
    """Loads ``weight_packed``/``weight_scale``/``weight_zero_point`` into :class:`IntLinear`."""

    name = "compressed-tensors"
    quantizes_dense = False

    def __init__(self, hf_config: dict[str, Any]) -> None:
        scheme = weight_scheme(hf_config)
        self.bits = int(scheme.get("num_bits", 4))
        if scheme.get("type", "int") != "int" or self.bits not in (4, 8):
            raise ValueError(f"compressed-tensors: only int4/int8 weights, got {scheme}")
        self.group_size = (int(scheme["group_size"]) if scheme.get("strategy") == "group"
                           else -1)
        self.symmetric = bool(scheme.get("symmetric", True))

    iter_tensors = staticmethod(iter_stored_tensors)

    def is_complete(self, shard: dict[str, Any]) -> bool:
        """A shard needs ``weight_packed``, ``weight_scale``, ``weight_shape`` and, for an
        asymmetric scheme, ``weight_zero_point``."""
        need = {"weight_packed", "weight_scale", "weight_shape"}
        if not self.symmetric:
            need.add("weight_zero_point")
        return need <= shard.keys()

    def build(self, spec: LayerSpec, shards: Shards,
              bias: torch.Tensor | None) -> IntLinear | None:
        """An :class:`IntLinear` of the shards' unpacked ``bits``-bit weights, stacked in row
        order; None when a shard lacks the packed tensors (a layer stored dense)."""
        if not all(self.is_complete(s) for s in shards):
            return None
        parts = [unpack_compressed_tensors(s, self.bits, self.group_size) for s in shards]
        return IntLinear(cat_rows(parts), bias, spec.gemm_dtype)
