"""The quantization method protocol, the registry of methods, and checkpoint detection.

A method turns the checkpoint's tensors of one fused linear layer (q/k/v or gate/up shards,
or a single projection) into a module; the loader (:mod:`.loading`) does the rest::

    checkpoint tensors ──iter_tensors──▶ per fused layer shards ──build──▶ QuantizedLinear
                                      └▶ everything else ──▶ model.load_weights (dense)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.engine.loader.checkpoint import GGUF_SUFFIX, Checkpoint

#: One fused layer's shards: for each of q/k/v (or gate/up, or the single projection) the
#: checkpoint tensors under that module, by suffix (``weight``, ``qweight``, ``scales``, ...).
Shards = list[dict[str, Any]]


@dataclass(frozen=True)
class LayerSpec:
    """What a method needs to know about the layer it builds.

    Attributes:
        name: our module name, e.g. ``model.layers.0.self_attn.qkv_proj``.
        in_features: input size.
        shard_sizes: output rows of each shard (``[q, k, v]``, ``[gate, up]`` or ``[out]``).
        gemm_dtype: dtype of the GEMM (fp32 on CPUs without native bf16).
    """

    name: str
    in_features: int
    shard_sizes: tuple[int, ...]
    gemm_dtype: torch.dtype


class QuantizationMethod(Protocol):
    """A weight quantization method (``--quantization NAME``).

    Attributes:
        name: the flag value.
        quantizes_dense: True for methods that quantize dense weights at load (fp8, rtn-*);
            False for methods that read already-quantized tensors (gguf, awq, gptq, ...).
    """

    name: str
    quantizes_dense: bool

    def iter_tensors(self, checkpoint: Checkpoint) -> Iterator[tuple[str, Any]]:
        """``(hf_name, value)`` for every stored tensor; quantized payloads stay packed."""
        ...

    def is_complete(self, shard: dict[str, Any]) -> bool:
        """Whether ``shard`` holds everything :meth:`build` needs for it (bias aside)."""
        ...

    def build(self, spec: LayerSpec, shards: Shards,
              bias: torch.Tensor | None) -> torch.nn.Module | None:
        """The quantized module for ``shards``, or None when they are dense (stay nn.Linear)."""
        ...


#: flag value -> factory(hf_config) -> method. Read-only after import (see ``register``).
_REGISTRY: dict[str, Callable[[dict[str, Any]], QuantizationMethod]] = {}

#: Values of ``--quantization``: "none" plus every registered method.
QUANTIZATION_CHOICES = ("none", "gguf", "fp8", "awq", "gptq", "compressed-tensors",
                        "rtn-int4", "rtn-int8")


def register(name: str) -> Callable:
    """Class decorator: register a method factory under ``name`` (must be in the choices)."""
    def wrap(factory: Callable) -> Callable:
        assert name in QUANTIZATION_CHOICES and name not in _REGISTRY, name
        _REGISTRY[name] = factory
        return factory
    return wrap


def detect_checkpoint_quantization(checkpoint: Checkpoint) -> str | None:
    """The method a checkpoint declares (``quantization_config.quant_method``), or None.

    A ``.gguf`` file declares nothing here: GGUF is dequantized at load unless
    ``--quantization gguf`` asks to keep it packed.

    Raises:
        ValueError: a declared method pdserve cannot load (named in the message).
    """
    qc = checkpoint.hf_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors" or method == "compressed_tensors":
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported "
                             "(only 'pack-quantized' int4/int8 weights)")
        return "compressed-tensors"
    if method in ("awq", "gptq"):
        return method
    raise ValueError(f"checkpoint quantization method {method!r} is not supported "
                     f"(supported: awq, gptq, compressed-tensors)")


def get_method(name: str, checkpoint: Checkpoint) -> QuantizationMethod:
    """Instantiate method ``name`` for ``checkpoint``.

    Raises:
        ValueError: unknown name, or a method that does not fit the checkpoint (gguf on a
            folder, a dense-quantizing method on a quantized checkpoint, awq on gptq, ...).
    """
    from pdserve.engine.quantization import methods  # noqa: F401  (registers the methods)

    if name not in _REGISTRY:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                         f"got {name!r}")
    declared = detect_checkpoint_quantization(checkpoint)
    is_gguf = checkpoint.path.suffix == GGUF_SUFFIX
    if name == "gguf" and not is_gguf:
        raise ValueError(f"--quantization gguf needs a .gguf model file, got {checkpoint.path}")
    if name != "gguf" and is_gguf and name not in ("none",):
        raise ValueError(f"--quantization {name} on a GGUF file ({checkpoint.path.name}): use "
                         "--quantization gguf (keeps its blocks packed) or load a safetensors "
                         "folder (for the default model, `pdserve pull` converts it into one)")
    method = _REGISTRY[name](checkpoint.hf_config)
    if method.quantizes_dense and declared is not None:
        raise ValueError(f"the checkpoint is already quantized ({declared}); "
                         f"--quantization {name} applies to dense checkpoints")
    if not method.quantizes_dense and name != "gguf" and declared != name:
        raise ValueError(f"--quantization {name} does not match the checkpoint "
                         f"(it declares {declared or 'no quantization'})")
    return method
