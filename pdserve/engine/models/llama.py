"""Llama (Touvron et al. 2023) decoder: the family the Qwen2/Qwen3 models extend.

``Attention -> DecoderLayer -> Model -> ForCausalLM``, reading like the paper: pre-norm
RMSNorm, GQA attention with RoPE over the paged KV cache, SwiGLU MLP. Q/K/V and gate/up are
fused projections; :meth:`LlamaForCausalLM.load_weights` maps Hugging Face parameter names
onto them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.config import ModelArchConfig
from pdserve.engine.layers.activation import silu_and_mul
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding, rope_from_hf_config

#: One layer's paged cache: ``(k_cache, v_cache)``, each
#: ``[num_blocks, block_size, num_kv_heads, head_dim]``; an FP8 cache adds
#: ``(k_scales, v_scales)``, each ``[num_blocks, num_kv_heads]`` fp32.
KVCache = tuple[torch.Tensor, ...]


class LlamaAttention(nn.Module):
    """Grouped-query attention over the paged KV cache.

    Class attributes let subclasses switch on the family's differences:
    ``qkv_bias`` (Qwen2), ``use_qk_norm`` (Qwen3: RMSNorm over each head of q and k).
    """

    qkv_bias: bool | None = None  # None: follow config.attention_bias
    use_qk_norm: bool = False

    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qkv_bias = cfg.attention_bias if self.qkv_bias is None else self.qkv_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.backend = backend

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                attn_metadata: Any) -> torch.Tensor:
        """``hidden [num_tokens, hidden_size] -> [num_tokens, hidden_size]``."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = self.rotary.rotate(positions, q), self.rotary.rotate(positions, k)
        else:  # queries and keys side by side: one rotation for both
            qk = self.rotary.rotate(
                positions, qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata, self.scale,
                                   kv_scales=kv_cache[2:] or None)
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused ``[gate ; up]`` projection."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        bias = bool(cfg.hf_config.get("mlp_bias", False))
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden_size] -> [num_tokens, hidden_size]``."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))`` (residual add fused in norm)."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, rotary, backend)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: KVCache,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` in and out, each ``[num_tokens, hidden_size]`` (``residual``
        None for the first layer); the residual add is fused into the next norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend,
                 max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = rope_from_hf_config(cfg.hf_config, cfg.head_dim, max_position)
        self.rotary = rotary  # shared by every layer's attention
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, rotary, backend) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
        attn_metadata: Any, aux_layer_ids: tuple[int, ...] = (),
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [num_tokens] int64 -> hidden [num_tokens, hidden_size]``.

        ``layer_done``, when given, is called with each layer's index once that layer has
        written its K/V (a prefill worker streaming KV layer by layer).

        With ``aux_layer_ids`` (EAGLE-3 feature fusion) it also returns ``aux
        [num_tokens, len(aux_layer_ids) * hidden_size]``: for each id ``i``, in the given
        order, the residual stream entering layer ``i`` (``hidden + residual``, i.e. the
        output of layer ``i - 1``; ``i = 0`` is the embedding), which is Hugging Face's
        ``output_hidden_states[i]`` and vLLM's ``eagle_aux_hidden_state_layer_ids``.
        """
        self.rotary.forget()
        if aux_layer_ids:
            return self._forward_with_aux(input_ids, positions, kv_caches, attn_metadata,
                                          aux_layer_ids, layer_done)
        hidden = self.embed_tokens(input_ids)
        residual = None
        for idx, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
            if layer_done is not None:
                layer_done(idx)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _forward_with_aux(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
        attn_metadata: Any, aux_layer_ids: tuple[int, ...],
        layer_done: Callable[[int], None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` that also collects the layer inputs named by ``aux_layer_ids``."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for idx, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if idx in aux_layer_ids:
                captured[idx] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
            if layer_done is not None:
                layer_done(idx)
        hidden, _ = self.norm(hidden, residual)
        missing = [i for i in aux_layer_ids if i not in captured]
        if missing:
            raise ValueError(f"aux_layer_ids {missing} are not layers of this model "
                             f"(0 .. {len(self.layers) - 1})")
        return hidden, torch.cat([captured[i] for i in aux_layer_ids], dim=-1)


#: HF checkpoint name fragment -> (our fused parameter fragment, shard index).
_STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head (tied to the embedding when the config says so)."""

    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend,
                 max_position: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = self.model_cls(cfg, backend, max_position)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
        attn_metadata: Any, aux_layer_ids: tuple[int, ...] = (),
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [num_tokens] -> hidden [num_tokens, hidden_size]`` (no logits).

        With ``aux_layer_ids``: ``(hidden, aux [num_tokens, len(ids) * hidden_size])``;
        ``layer_done``: see :meth:`LlamaModel.forward`.
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata, aux_layer_ids,
                          layer_done)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [num_rows, hidden_size] -> logits [num_rows, vocab_size]`` fp32."""
        return self.lm_head(hidden).float()

    def _shard_sizes(self, fused: str) -> list[int]:
        cfg = self.cfg
        if fused == ".qkv_proj.":
            kv = cfg.num_kv_heads * cfg.head_dim
            return [cfg.num_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the fused parameters.

        Returns:
            The names of our parameters that were written.

        Raises:
            ValueError: for an unexpected tensor name or a shape mismatch, and (after the
                loop) for any parameter, or shard of a fused one, the checkpoint did not
                provide (built without random init, it would hold whatever memory held).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards: set[tuple[str, int]] = set()  # (fused parameter, shard index) written
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, shard = name, None
            for hf_frag, our_frag, idx in _STACKED_PARAMS:
                if hf_frag in name:
                    target, shard = name.replace(hf_frag, our_frag), (our_frag, idx)
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            param = params[target]
            dest = param.data
            if shard is not None:
                sizes = self._shard_sizes(shard[0])
                start = sum(sizes[: shard[1]])
                dest = dest.narrow(0, start, sizes[shard[1]])
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(target)
            if shard is not None:
                shards.add((target, shard[1]))
        missing = set(params) - loaded
        for target in loaded:  # a fused parameter lacking a shard (e.g. v_proj) is missing too
            fused = next((f for f in (".qkv_proj.", ".gate_up_proj.") if f in target), None)
            if fused and any((target, i) not in shards
                             for i in range(len(self._shard_sizes(fused)))):
                missing.add(f"{target} (a shard of it)")
        if self.cfg.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing parameters: {sorted(missing)[:5]}")
        return loaded
