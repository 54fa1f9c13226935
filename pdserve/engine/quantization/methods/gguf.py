"""``--quantization gguf``: GGUF linear weights stay in their GGML blocks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import torch

from pdserve.engine.loader.checkpoint import Checkpoint
from pdserve.engine.quantization.gguf_blocks import BLOCK_DEQUANTIZERS
from pdserve.engine.quantization.gguf_linear import GGUFLinear, GGUFPackedWeight
from pdserve.engine.quantization.registry import LayerSpec, Shards, register


@register("gguf")
class GGUFMethod:
    """Keeps Q4_0/Q4_1/Q8_0/Q4_K/Q6_K linear weights packed; other tensors are dequantized."""

    name = "gguf"
    quantizes_dense = False

    def __init__(self, hf_config: dict[str, Any]) -> None:
        del hf_config

    def iter_tensors(self, checkpoint: Checkpoint) -> Iterator[tuple[str, Any]]:
        """``(hf_name, value)`` in file order, Q/K rows in Hugging Face order.

        A 2-D ``.weight`` of a packed GGML type comes as a :class:`GGUFPackedWeight`
        (``[rows, row_bytes]`` uint8 blocks); every other tensor is dequantized to fp32.
        """
        for name, ggml_type, payload in checkpoint.source.iter_raw_tensors():
            if ggml_type in BLOCK_DEQUANTIZERS and name.endswith(".weight") and payload.dim() == 2:
                _, values, nbytes = BLOCK_DEQUANTIZERS[ggml_type]
                yield name, GGUFPackedWeight(ggml_type, payload,
                                             payload.shape[1] // nbytes * values)
            else:
                values = gguf.quants.dequantize(payload.numpy(), ggml_type)
                yield name, torch.from_numpy(values.copy())

    def is_complete(self, shard: dict[str, Any]) -> bool:
        """A shard needs its ``weight`` (packed or float)."""
        return "weight" in shard

    def build(self, spec: LayerSpec, shards: Shards,
              bias: torch.Tensor | None) -> GGUFLinear | None:
        """A :class:`GGUFLinear` over the shards' packed weights, one segment each; None when
        a shard is stored as floats (F32/F16/BF16: the layer stays dense)."""
        parts = [s["weight"] for s in shards]
        if not all(isinstance(p, GGUFPackedWeight) for p in parts):
            return None
        return GGUFLinear(parts, bias, spec.gemm_dtype)
