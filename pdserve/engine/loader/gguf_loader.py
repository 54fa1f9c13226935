"""Read a GGUF file as a Hugging Face style checkpoint.

A GGUF file carries llama.cpp tensor names (``blk.3.attn_q.weight``), llama.cpp
metadata keys (``llama.block_count``) and quantized tensor payloads. This module
turns all three into what the rest of the engine expects: Hugging Face parameter
names, a ``config.json``-style dict and dequantized ``torch.Tensor`` values.

NOTE: llama.cpp's converter permutes the rows of the Q and K projections of
``llama`` models from Hugging Face's half-split RoPE layout (``rotate_half``)
into the interleaved layout llama.cpp uses. For one head of ``head_dim`` rows::

    Hugging Face rows:  [x0 x1 ... x(h/2-1) | y0 y1 ... y(h/2-1)]     (h = head_dim)
    GGUF rows:          [x0 y0 x1 y1 ... x(h/2-1) y(h/2-1)]

``GGUFWeightSource`` undoes that permutation for architectures whose spec sets
``has_interleaved_qk_rows`` (``llama``), so every tensor it yields is in the
Hugging Face layout. ``qwen2`` and ``qwen3`` are converted without the permutation.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np
import torch

from pdserve.engine.config import ModelArchConfig

# GGML tensor types whose dequantization we support (and test).
SUPPORTED_GGML_TYPES = frozenset(
    {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q4_K,
        gguf.GGMLQuantizationType.Q5_K,
        gguf.GGMLQuantizationType.Q6_K,
    }
)


@dataclass(frozen=True)
class GGUFArchSpec:
    """How one GGUF ``general.architecture`` maps onto a Hugging Face model class."""

    hf_architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # config.json "model_type"
    has_interleaved_qk_rows: bool  # llama.cpp permuted Q/K rows on conversion
    default_rope_theta: float


# Registry: GGUF architecture name -> spec. Read-only.
GGUF_ARCH_SPECS: MappingProxyType[str, GGUFArchSpec] = MappingProxyType(
    {
        "llama": GGUFArchSpec("LlamaForCausalLM", "llama", True, 10000.0),
        "qwen2": GGUFArchSpec("Qwen2ForCausalLM", "qwen2", False, 1000000.0),
        "qwen3": GGUFArchSpec("Qwen3ForCausalLM", "qwen3", False, 1000000.0),
    }
)

# Top-level (not per-block) tensors: GGUF name -> Hugging Face name.
_GLOBAL_TENSOR_NAMES = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)

# Per-block tensors: GGUF suffix after "blk.N." -> Hugging Face suffix after "model.layers.N.".
_BLOCK_TENSOR_NAMES = MappingProxyType(
    {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight",
        "attn_output.bias": "self_attn.o_proj.bias",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
)

# Special token ids: GGUF tokenizer metadata key -> config.json key. Read-only.
GGUF_TOKEN_ID_KEYS = MappingProxyType(
    {
        "tokenizer.ggml.bos_token_id": "bos_token_id",
        "tokenizer.ggml.eos_token_id": "eos_token_id",
        "tokenizer.ggml.padding_token_id": "pad_token_id",
    }
)

_BLOCK_NAME_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_hf_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its Hugging Face parameter name.

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
        ValueError: the name is not one of the dense decoder tensors we support
            (for example ``rope_freqs.weight`` of Llama 3 GGUFs, or MoE experts).
    """
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _BLOCK_NAME_RE.match(gguf_name)
    if match is not None and match.group(2) in _BLOCK_TENSOR_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_TENSOR_NAMES[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in pdserve")


def read_gguf_metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Return the value of metadata ``key`` (scalar, string or list), or ``default`` if absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _num_array_items(reader: gguf.GGUFReader, key: str) -> int | None:
    """Length of array metadata ``key`` without decoding its items; None if absent."""
    field = reader.fields.get(key)
    return None if field is None else len(field.data)


def gguf_arch_spec(reader: gguf.GGUFReader, path: Path) -> tuple[str, GGUFArchSpec]:
    """Return ``(arch, spec)`` for the file's ``general.architecture``.

    Raises:
        ValueError: the architecture key is missing or not in ``GGUF_ARCH_SPECS``.
    """
    arch = read_gguf_metadata(reader, "general.architecture")
    if arch not in GGUF_ARCH_SPECS:
        raise ValueError(
            f"GGUF file {path} has architecture {arch!r}; "
            f"supported architectures are {sorted(GGUF_ARCH_SPECS)}"
        )
    return arch, GGUF_ARCH_SPECS[arch]


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    """Hugging Face ``rope_scaling`` from ``{arch}.rope.scaling.*`` keys, or None."""
    scaling_type = read_gguf_metadata(reader, f"{arch}.rope.scaling.type")
    if scaling_type is None or scaling_type == "none":
        return None
    rope_scaling: dict[str, Any] = {"rope_type": scaling_type}
    factor = read_gguf_metadata(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        rope_scaling["factor"] = factor
    original_len = read_gguf_metadata(reader, f"{arch}.rope.scaling.original_context_length")
    if original_len is not None:
        rope_scaling["original_max_position_embeddings"] = original_len
    attn_factor = read_gguf_metadata(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        rope_scaling["attention_factor"] = attn_factor
    return rope_scaling


def gguf_to_hf_config(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    """Build a ``config.json``-style dict from GGUF metadata.

    Raises:
        ValueError: unsupported architecture, or a required key
            (``{arch}.block_count``, ``embedding_length``, ``feed_forward_length``,
            ``attention.head_count``) is missing.
    """
    arch, spec = gguf_arch_spec(reader, path)

    def required(suffix: str) -> Any:
        value = read_gguf_metadata(reader, f"{arch}.{suffix}")
        if value is None:
            raise ValueError(f"GGUF file {path} lacks required metadata key '{arch}.{suffix}'")
        return value

    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = _num_array_items(reader, "tokenizer.ggml.tokens")
    if vocab_size is None:
        vocab_size = read_gguf_metadata(reader, f"{arch}.vocab_size")
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": read_gguf_metadata(
            reader, f"{arch}.attention.head_count_kv", num_heads
        ),
        "head_dim": read_gguf_metadata(
            reader, f"{arch}.attention.key_length", hidden_size // num_heads
        ),
        "max_position_embeddings": read_gguf_metadata(reader, f"{arch}.context_length"),
        "rms_norm_eps": read_gguf_metadata(
            reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6
        ),
        "rope_theta": read_gguf_metadata(reader, f"{arch}.rope.freq_base", spec.default_rope_theta),
        "rope_scaling": _rope_scaling(reader, arch),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for gguf_key, hf_key in GGUF_TOKEN_ID_KEYS.items():
        value = read_gguf_metadata(reader, gguf_key)
        if value is not None:
            config[hf_key] = value
    return config


def unpermute_interleaved_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE -> half-split RoPE).

    Args:
        weight: ``[num_heads * head_dim, hidden_size]`` (or ``[num_heads * head_dim]``
            for a bias), any dtype, rows in llama.cpp's interleaved order.
        num_heads: query heads for Q, key/value heads for K.

    Returns:
        Same shape and dtype, rows in Hugging Face order (see module docstring).
    """
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    # [num_heads, head_dim/2, 2, ...] -> [num_heads, 2, head_dim/2, ...]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


class GGUFWeightSource:
    """Dequantizing, name-mapping iterator over the tensors of an open GGUF file.

    Every tensor's type and name are checked on construction, so a file we cannot
    load fails before any weight is dequantized.

    Args:
        reader: the open file.
        path: its path (for error messages).
        arch: the architecture parsed from the file's metadata; its ``num_heads`` and
            ``num_kv_heads`` size the Q and K row permutation that is undone.
    """

    def __init__(self, reader: gguf.GGUFReader, path: Path, arch: ModelArchConfig) -> None:
        """Raises ValueError naming the tensor for an unsupported name or GGML type."""
        _, spec = gguf_arch_spec(reader, path)
        self._reader = reader
        self._hf_names: list[str] = []
        for tensor in reader.tensors:
            if tensor.tensor_type not in SUPPORTED_GGML_TYPES:
                supported = sorted(t.name for t in SUPPORTED_GGML_TYPES)
                raise ValueError(
                    f"GGUF tensor {tensor.name!r} in {path} has type {tensor.tensor_type.name}, "
                    f"which pdserve cannot dequantize (supported: {', '.join(supported)})"
                )
            self._hf_names.append(gguf_to_hf_name(tensor.name))
        # HF name -> number of heads whose rows must be un-interleaved.
        self._num_heads_to_unpermute: dict[str, int] = {}
        if spec.has_interleaved_qk_rows:
            for hf_name in self._hf_names:
                if ".self_attn.q_proj." in hf_name:
                    self._num_heads_to_unpermute[hf_name] = arch.num_heads
                elif ".self_attn.k_proj." in hf_name:
                    self._num_heads_to_unpermute[hf_name] = arch.num_kv_heads

    @property
    def num_tensors(self) -> int:
        """Tensors in the file, each yielded once by ``iter_tensors``/``iter_raw_tensors``."""
        return len(self._hf_names)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` in file order; tensors are float32 in HF layout.

        Shapes follow Hugging Face (``[out_features, in_features]`` for linears).
        """
        for tensor, hf_name in zip(self._reader.tensors, self._hf_names, strict=True):
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32
            if not values.flags.writeable:  # F32 payloads are read-only views of the mmap
                values = np.array(values, copy=True)
            weight = torch.from_numpy(values)
            num_heads = self._num_heads_to_unpermute.get(hf_name)
            if num_heads is not None:
                weight = unpermute_interleaved_rows(weight, num_heads)
            yield hf_name, weight

    def iter_raw_tensors(self) -> Iterator[tuple[str, gguf.GGMLQuantizationType, torch.Tensor]]:
        """Yield ``(hf_name, ggml_type, payload)`` in file order, without dequantizing.

        ``payload`` is a copy of the stored data: ``[rows, row_bytes]`` uint8 blocks for
        quantized types, the stored array otherwise; Q/K rows are already in Hugging Face
        order (every GGML row is whole blocks, so rows permute as units).
        """
        for tensor, hf_name in zip(self._reader.tensors, self._hf_names, strict=True):
            payload = torch.from_numpy(np.array(tensor.data, copy=True))
            num_heads = self._num_heads_to_unpermute.get(hf_name)
            if num_heads is not None:
                payload = unpermute_interleaved_rows(payload, num_heads)
            yield hf_name, tensor.tensor_type, payload


def open_gguf(path: Path) -> tuple[dict[str, Any], GGUFWeightSource]:
    """Open ``path`` (memory-mapped) and return ``(hf_config, weight_source)``.

    ``hf_config`` is parsed into a :class:`ModelArchConfig` here, once, for the weight
    source; the engine parses it again from the returned dict.

    Raises:
        ValueError: not a readable GGUF file, one shard of a split GGUF,
            unsupported architecture, tensor name or tensor type, or metadata that
            :meth:`ModelArchConfig.from_hf_config` rejects.
    """
    try:
        reader = gguf.GGUFReader(path)
    except ValueError as exc:  # bad magic / version
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    num_splits = read_gguf_metadata(reader, "split.count", 1)
    if num_splits > 1:
        raise ValueError(
            f"{path} is one of {num_splits} shards of a split GGUF; merge the shards "
            "into one file first (llama-gguf-split --merge)"
        )
    hf_config = gguf_to_hf_config(reader, path)
    arch = ModelArchConfig.from_hf_config(hf_config)
    return hf_config, GGUFWeightSource(reader, path, arch)
