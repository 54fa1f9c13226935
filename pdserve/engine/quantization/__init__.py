"""Weight quantization behind one switch, ``--quantization``: GGUF blocks, FP8, int4/int8.

Methods live in :mod:`.methods` (one file each) behind the registry of :mod:`.registry`;
:mod:`.loading` swaps the model's linear layers at load time. ``pdserve quantize`` (AWQ or
RTN, in :mod:`pdserve.offline.quantize`) writes checkpoints the engine loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.config import ModelArchConfig
from pdserve.engine.loader.checkpoint import Checkpoint
from pdserve.engine.quantization.loading import WeightMemory, load_quantized, weight_memory
from pdserve.engine.quantization.registry import (
    QUANTIZATION_CHOICES,
    QuantizationMethod,
    detect_checkpoint_quantization,
    get_method,
)

__all__ = [
    "QUANTIZATION_CHOICES",
    "QuantizationMethod",
    "ResolvedQuantization",
    "WeightMemory",
    "load_model_weights",
    "prepare_cpu_gemms",
    "resolve_quantization",
    "weight_memory",
]


@dataclass(frozen=True)
class ResolvedQuantization:
    """The method to load with; ``dequantize_all`` for ``none`` on a quantized checkpoint."""

    method: QuantizationMethod
    dequantize_all: bool


def resolve_quantization(requested: str | None, checkpoint: Checkpoint) -> ResolvedQuantization | None:
    """Decide how to load ``checkpoint``: None means the plain dense path.

    ``requested`` None auto-detects (a checkpoint's ``quantization_config``); ``"none"``
    dequantizes a quantized checkpoint at load.

    Raises:
        ValueError: see :func:`~.registry.get_method`.
    """
    declared = detect_checkpoint_quantization(checkpoint)
    if requested in (None, "none"):
        if declared is None:
            return None
        return ResolvedQuantization(get_method(declared, checkpoint), requested == "none")
    return ResolvedQuantization(get_method(requested, checkpoint), False)


def load_model_weights(model: nn.Module, arch: ModelArchConfig, checkpoint: Checkpoint,
                       quantization: str | None, skip: tuple[str, ...], dtype: torch.dtype,
                       gemm_dtype: torch.dtype, progress: bool = True) -> None:
    """Load ``checkpoint`` into ``model``, quantized as asked.

    Raises:
        ValueError: a bad method for this checkpoint, or any loading error.
    """
    resolved = resolve_quantization(quantization, checkpoint)
    if resolved is None:
        model.load_weights(checkpoint.iter_weights(dtype, progress=progress))
    else:
        load_quantized(model, arch, checkpoint, resolved.method, dtype, gemm_dtype, skip,
                       resolved.dequantize_all)


def prepare_cpu_gemms(model: nn.Module, dtype: torch.dtype) -> int:
    """Build every quantized layer's packed CPU GEMMs for ``dtype`` activations now, at
    load, instead of in the first request's step; returns how many layers have them."""
    from pdserve.engine.quantization.base import QuantizedLinear  # noqa: PLC0415
    from pdserve.engine.quantization.cpu_packed import PACKED_ACTIVATION_DTYPES  # noqa: PLC0415

    if dtype not in PACKED_ACTIVATION_DTYPES:
        return 0
    return sum(mod.cpu_gemms(dtype) is not None for mod in model.modules()
               if isinstance(mod, QuantizedLinear))
