"""Qwen2 (Yang et al. 2024): the Llama block with biases on the Q/K/V projections."""

from __future__ import annotations

from pdserve.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen2Attention(LlamaAttention):
    """Llama attention with a bias on the fused Q/K/V projection."""

    qkv_bias = True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    """The Llama block around :class:`Qwen2Attention`."""

    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    """Embedding, Qwen2 decoder layers, final norm."""

    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``Qwen2ForCausalLM`` checkpoints (Qwen2, Qwen2.5)."""

    model_cls = Qwen2Model
