"""Qwen3 (Qwen team 2025): the Llama block with per-head RMSNorm on queries and keys
(applied before RoPE), optional Q/K/V/O bias from ``attention_bias``."""

from __future__ import annotations

from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    """Llama attention with RMSNorm over each query and key head, before RoPE."""

    use_qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """The Llama block around :class:`Qwen3Attention`."""

    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    """Embedding, Qwen3 decoder layers, final norm."""

    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``Qwen3ForCausalLM`` checkpoints (dense Qwen3)."""

    model_cls = Qwen3Model
