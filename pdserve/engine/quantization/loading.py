"""Load a model with quantized linear layers: the load-time module swap behind ``--quantization``.

NOTE: model files are never touched. Before weights stream in, every fused linear layer of
the model (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, an untied ``lm_head``)
is replaced by a parameterless placeholder, so ``model.load_weights`` sees only the dense
rest (embeddings, norms). The layer's checkpoint tensors are collected per shard (q/k/v,
gate/up) and, once complete, the method builds the module that replaces the placeholder:
a quantized layer, or a dense ``nn.Linear`` when the layer is on the skip list (quantized
tensors are then dequantized) or stored dense. Packed payloads never exist dense in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.config import ModelArchConfig
from pdserve.engine.loader.checkpoint import Checkpoint
from pdserve.engine.quantization.base import QuantizedLinear
from pdserve.engine.quantization.gguf_linear import GGUFPackedWeight
from pdserve.engine.quantization.registry import LayerSpec, QuantizationMethod, Shards

logger = logging.getLogger(__name__)

#: Hugging Face projection -> (our fused projection, shard index).
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class _PendingLinear(nn.Module):
    """Stands in for a linear layer whose weights have not arrived yet (no parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never called
        raise RuntimeError("linear layer used before its weights were loaded")


def is_skipped(module_name: str, skip: tuple[str, ...]) -> bool:
    """Whether ``module_name`` matches a skip pattern: a dotted run of name components.

    ``lm_head`` matches ``lm_head``; ``layers.0`` matches ``model.layers.0.mlp.down_proj``
    but not ``model.layers.10...``; Hugging Face projection names (``q_proj``) match the
    fused layer holding them (``qkv_proj``).
    """
    dotted = f".{module_name}."
    for pattern in skip:
        fused = FUSED_SHARDS.get(pattern.rsplit(".", 1)[-1])
        if fused is not None:
            pattern = pattern.rsplit(".", 1)[0] + "." + fused[0] if "." in pattern else fused[0]
        if f".{pattern.strip('.')}." in dotted:
            return True
    return False


def shard_sizes(arch: ModelArchConfig, fused: str, out_features: int) -> tuple[int, ...]:
    """Output rows of each checkpoint shard of our layer ``fused`` (``qkv_proj``: q, k, v)."""
    if fused == "qkv_proj":
        kv = arch.num_kv_heads * arch.head_dim
        return (arch.num_heads * arch.head_dim, kv, kv)
    if fused == "gate_up_proj":
        return (arch.intermediate_size, arch.intermediate_size)
    return (out_features,)


@dataclass
class _Pending:
    """A linear layer waiting for its checkpoint tensors, one dict per shard."""

    spec: LayerSpec
    has_bias: bool
    shards: Shards

    def is_complete(self, method: QuantizationMethod) -> bool:
        """Whether every shard holds what ``method`` builds from (and its bias, if any)."""
        return all(method.is_complete(s) and (not self.has_bias or "bias" in s)
                   for s in self.shards)


def _split_name(hf_name: str) -> tuple[str, int, str]:
    """``model.layers.0.self_attn.k_proj.qweight`` -> (``...self_attn.qkv_proj``, 1, ``qweight``)."""
    module, _, suffix = hf_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in FUSED_SHARDS:
        fused, idx = FUSED_SHARDS[leaf]
        return f"{parent}.{fused}", idx, suffix
    return module, 0, suffix


def _dense_linear(spec: LayerSpec, weight: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> nn.Linear:
    """A frozen CPU ``nn.Linear`` in ``dtype`` holding ``weight [out, in]`` and ``bias [out]``."""
    layer = nn.Linear(spec.in_features, weight.shape[0], bias=bias is not None, dtype=dtype,
                      device="cpu")
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    layer.requires_grad_(False)
    return layer


def _build(method: QuantizationMethod, pending: _Pending, skip: tuple[str, ...],
           dequantize_all: bool, dtype: torch.dtype) -> nn.Module:
    """The module that replaces ``pending``'s placeholder: ``method``'s quantized layer, or a
    dense ``nn.Linear`` in ``dtype`` when the layer is skipped or stored dense."""
    shards = pending.shards
    bias = None
    if pending.has_bias:
        bias = torch.cat([s["bias"] for s in shards]).to(dtype)
    skipped = dequantize_all or is_skipped(pending.spec.name, skip)
    if skipped and method.quantizes_dense:
        module = None
    else:
        module = method.build(pending.spec, shards, bias)
    if module is None:
        weight = torch.cat([s["weight"] for s in shards])
        return _dense_linear(pending.spec, weight, bias, dtype)
    if skipped and isinstance(module, QuantizedLinear):
        return _dense_linear(pending.spec, module.dequantize(torch.float32), bias, dtype)
    return module


def _replace_linears_with_placeholders(model: nn.Module, arch: ModelArchConfig,
                                       gemm_dtype: torch.dtype) -> dict[str, _Pending]:
    """Swap each ``nn.Linear`` of ``model`` (a tied ``lm_head`` aside) for a placeholder.

    Returns:
        module name -> the layer's spec and one empty tensor dict per checkpoint shard.
    """
    tied = arch.tie_word_embeddings
    pending: dict[str, _Pending] = {}
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or (tied and name == "lm_head"):
            continue
        leaf = name.rpartition(".")[2]
        sizes = shard_sizes(arch, leaf, mod.out_features)
        spec = LayerSpec(name, mod.in_features, sizes, gemm_dtype)
        pending[name] = _Pending(spec, mod.bias is not None, [{} for _ in sizes])
        model.set_submodule(name, _PendingLinear())
    return pending


def load_quantized(model: nn.Module, arch: ModelArchConfig, checkpoint: Checkpoint,
                   method: QuantizationMethod, dtype: torch.dtype, gemm_dtype: torch.dtype,
                   skip: tuple[str, ...] = (), dequantize_all: bool = False) -> int:
    """Load ``checkpoint`` into ``model`` with its linear layers built by ``method``.

    Args:
        model: a freshly constructed model (its ``nn.Linear`` layers are replaced).
        arch: the model's architecture (shard sizes of the fused layers).
        checkpoint: the opened checkpoint.
        method: the quantization method.
        dtype: model dtype (dense tensors, biases).
        gemm_dtype: dtype quantized layers compute their GEMMs in.
        skip: skip patterns (see :func:`is_skipped`): those layers stay dense.
        dequantize_all: dequantize every quantized layer (``--quantization none`` on a
            quantized checkpoint).

    Returns:
        The number of quantized layers.

    Raises:
        ValueError: a linear layer whose tensors the checkpoint lacks, or any error of
            ``model.load_weights``.
    """
    device = next(model.parameters()).device
    pending = _replace_linears_with_placeholders(model, arch, gemm_dtype)
    num_quantized = 0

    def install(module: str, entry: _Pending) -> None:
        nonlocal num_quantized
        built = _build(method, entry, skip, dequantize_all, dtype)
        num_quantized += isinstance(built, QuantizedLinear)
        model.set_submodule(module, built.to(device))

    def dense_rest() -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, value in method.iter_tensors(checkpoint):
            module, idx, suffix = _split_name(hf_name)
            entry = pending.get(module)
            if entry is None:
                if isinstance(value, GGUFPackedWeight):  # e.g. a Q8_0 embedding
                    value = value.dequantize()
                yield hf_name, value.to(dtype)
                continue
            entry.shards[idx][suffix] = value
            if entry.is_complete(method):
                install(module, entry)
                del pending[module]

    model.load_weights(dense_rest())
    for module, entry in list(pending.items()):
        if not any(entry.shards):
            raise ValueError(f"checkpoint has no weights for layer {module!r}")
        install(module, entry)
    logger.info("%s: %d quantized linear layers", method.name, num_quantized)
    return num_quantized


@dataclass(frozen=True)
class WeightMemory:
    """Weight bytes of a loaded model.

    Attributes:
        total_bytes: every parameter and buffer (shared tensors once).
        quantized_bytes: packed weights + scales/zeros of the quantized layers.
        quantized_bf16_bytes: what those layers' weights take in bf16.
        num_quantized_layers: how many layers are quantized.
    """

    total_bytes: int
    quantized_bytes: int
    quantized_bf16_bytes: int
    num_quantized_layers: int

    @property
    def quantized_ratio(self) -> float:
        """``quantized_bytes / quantized_bf16_bytes`` (0 when nothing is quantized)."""
        return self.quantized_bytes / self.quantized_bf16_bytes if self.quantized_bf16_bytes else 0.0


def weight_memory(model: nn.Module) -> WeightMemory:
    """Count the weight bytes of ``model`` (see :class:`WeightMemory`)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    return WeightMemory(
        total_bytes=total,
        quantized_bytes=sum(m.packed_bytes() for m in layers),
        quantized_bf16_bytes=sum(2 * m.in_features * m.out_features for m in layers),
        num_quantized_layers=len(layers),
    )


