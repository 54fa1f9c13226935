"""An EAGLE-1 head's decoder layer in the fused CPU decode kernel, for drafting steps.

A draft step runs the head at a few rows (one per request chained, or a request's few
accepted positions ingested). Op by op, the layer's PyTorch ops (attention metadata,
rotary, paged attention, norm, activation) around its four small GEMVs cost more than the
GEMVs: on a 2-core Xeon with AMX one chained head forward took 0.93 ms eager against 0.11
ms for its fc plus 0.33 ms for the layer in the fused kernel (:mod:`pdserve.engine.kernels.
cpu_decode`, the target's decode path), with two forwards a drafting step against a ~12 ms
verification. The kernel runs the layer with no input norm and no final norm (eagle1's
layout); numerics are the eager bf16 layer's (every value the eager path holds in bf16 is
rounded at the same point). The fc over ``[embedding ; feature]`` stays the head's own layer.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.attention.base import AttentionInputs
from pdserve.engine.compiled.fused_decode import (
    _bias,
    _norm_weight,
    linear_segments,
    step_tables,
)
from pdserve.engine.kernels.cpu_decode import MAX_FUSED_TOKENS, cpu_decode_module
from pdserve.engine.layers.linear import Fp32GemmLinear
from pdserve.engine.spec_decode.eagle1_head import Eagle1DraftModel


class FusedEagleLayer:
    """``head``'s layer in the fused kernel (build with :meth:`build`).

    Args:
        module: the built kernel extension.
        head: an EAGLE-1 head with bf16 weights (``nn.Linear`` in bf16, or
            :class:`Fp32GemmLinear`'s bf16 copy where the CPU has no native bf16 GEMM).
        kv_cache: the drafter's cache, bf16 ``[1, 2, blocks, block_size, kv_heads,
            head_dim]`` contiguous.
    """

    def __init__(self, module, head: Eagle1DraftModel, kv_cache: torch.Tensor) -> None:
        layer = head.layer
        attn, mlp = layer.self_attn, layer.mlp
        self.head = head
        self.kv_cache = kv_cache
        self.decoder = module.FusedDecoder(
            head.cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            mlp.down_proj.in_features, float(layer.post_attention_layernorm.eps),
            attn.rotary.cos_cached, attn.rotary.signed_sin_cached, torch.empty(0))
        parts = []
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            parts += [linear_segments(lin), _bias(lin)]
        none = torch.empty(0)
        self.decoder.add_layer(none, _norm_weight(layer.post_attention_layernorm),
                               _norm_weight(getattr(attn, "q_norm", None)),
                               _norm_weight(getattr(attn, "k_norm", None)), *parts)

    @classmethod
    def build(cls, head: nn.Module, kv_cache: torch.Tensor) -> FusedEagleLayer | None:
        """The fused layer, or None where it does not apply: not an EAGLE-1 head, weights or
        cache not bf16 on the CPU, or no kernel on this machine."""
        if not isinstance(head, Eagle1DraftModel) or kv_cache.device.type != "cpu":
            return None
        layer = head.layer
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)
        bf16 = all(isinstance(lin, Fp32GemmLinear)
                   or (type(lin) is nn.Linear and lin.weight.dtype == torch.bfloat16)
                   for lin in linears)
        if (kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 6 or kv_cache.shape[0] != 1
                or not kv_cache.is_contiguous() or not bf16):
            return None
        module = cpu_decode_module()
        return None if module is None else cls(module, head, kv_cache)

    @staticmethod
    def can_run(num_tokens: int, hidden: torch.Tensor | None) -> bool:
        """Whether a forward of ``num_tokens`` rows (with features ``hidden``) runs fused:
        decode-sized steps (at most ``MAX_FUSED_TOKENS`` rows) with features."""
        return hidden is not None and 0 < num_tokens <= MAX_FUSED_TOKENS

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
            inputs: AttentionInputs) -> torch.Tensor:
        """The head's forward (:meth:`Eagle1DraftModel.forward`'s result).

        Args:
            input_ids, positions: ``[N]`` int64; hidden: ``[N, H]`` the features.
            inputs: the step's attention inputs (slots, query lengths, block tables).

        Returns:
            ``[N, H]`` bf16.

        Raises:
            RuntimeError: a position, slot or context outside the tables (the kernel checks).
        """
        embeds = self.head.target.model.embed_tokens(input_ids).to(hidden.dtype)
        x = self.head.fc(torch.cat([embeds, hidden], dim=-1))
        table, rows = step_tables(inputs.block_tables, inputs.query_lens)
        out, _ = self.decoder.forward(x.to(torch.bfloat16), positions, inputs.slot_mapping,
                                      table, rows, self.kv_cache, [], None)
        return out
