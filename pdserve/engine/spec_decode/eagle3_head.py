"""The EAGLE-3 head: ``fc`` over fused low/mid/high target features, its own LM head.

Official names: ``fc.weight [H, 3*H_target]``, ``midlayer.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj [*, 2H]``,
``midlayer.self_attn.o_proj``, ``midlayer.mlp.*``, ``norm.weight``,
``lm_head.weight [V_draft, H]``, ``d2t [V_draft]`` int64, ``t2d [V_target]`` bool
(see :mod:`pdserve.engine.spec_decode.eagle`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.config import ModelArchConfig
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.models.llama import KVCache, LlamaForCausalLM
from pdserve.engine.spec_decode.eagle_config import Eagle3Config, EagleConfig
from pdserve.engine.spec_decode.eagle_head import (
    EagleDecoderLayer,
    EagleDraftModel,
    check_draft_vocab_fits,
)


class Eagle3DecoderLayer(EagleDecoderLayer):
    """eagle3's layer: ``hidden_norm`` for the feature, ``input_layernorm`` for the
    embedding; its Q/K/V projections read their concatenation (``2H`` wide) and the
    feature is the residual."""

    def __init__(self, cfg: EagleConfig, arch: ModelArchConfig, backend: AttentionBackend,
                 max_position: int) -> None:
        super().__init__(cfg, arch, backend, max_position)
        attn = self.self_attn
        attn.qkv_proj = nn.Linear(2 * cfg.hidden_size, attn.q_size + 2 * attn.kv_size,
                                  bias=arch.attention_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1), \
            hidden


class Eagle3DraftModel(EagleDraftModel):
    """An EAGLE-3 head (see :class:`EagleDraftModel` for the interface and arguments)."""

    config_class = Eagle3Config

    def __init__(self, cfg: EagleConfig, target: LlamaForCausalLM, backend: AttentionBackend,
                 max_position: int) -> None:
        super().__init__(cfg, target, backend, max_position)
        arch = self.cfg.arch_config(self.target_vocab_size)
        self.midlayer = Eagle3DecoderLayer(self.cfg, arch, backend, max_position)
        self.norm = RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)
        self.lm_head = nn.Linear(self.cfg.hidden_size, self.cfg.draft_vocab_size, bias=False)
        self._register_vocab_maps()

    @staticmethod
    def _fit_target(cfg: EagleConfig, target: ModelArchConfig) -> EagleConfig:
        """``cfg`` with ``aux_layer_ids`` resolved (the default low/mid/high when the
        checkpoint names none); widths, vocabulary and layers checked."""
        fused_width = cfg.target_hidden_size or cfg.hidden_size
        if fused_width != target.hidden_size:
            raise ValueError(f"EAGLE-3 head fuses features of width {fused_width}; the "
                             f"target's hidden_size is {target.hidden_size}")
        if cfg.hidden_size != target.hidden_size:
            raise ValueError(f"EAGLE-3 head hidden_size {cfg.hidden_size} differs from the "
                             f"target's embedding width {target.hidden_size}")
        check_draft_vocab_fits(cfg, target)
        aux = cfg.resolve_aux_layer_ids(cfg.aux_layer_ids, target.num_layers)
        if max(aux) >= target.num_layers or min(aux) < 0:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(aux)} are not layers of "
                             f"the target (0 .. {target.num_layers - 1})")
        return replace(cfg, aux_layer_ids=aux)

    @property
    def layer(self) -> Eagle3DecoderLayer:
        """``midlayer``."""
        return self.midlayer

    def combine_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``fc(target_hidden)``: ``[N, 3 * H]`` fused target features -> ``[N, H]``."""
        return self.fc(target_hidden)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: Any) -> torch.Tensor:
        """The embedding and ``hidden`` through ``midlayer`` (output before the final norm);
        see :meth:`EagleDraftModel.forward` for the shapes."""
        embeds = self.target.model.embed_tokens(input_ids).to(hidden.dtype)
        return self.midlayer(positions, embeds, hidden, kv_caches[0], attn_metadata)

    def compute_draft_logits(self, draft_hidden: torch.Tensor,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Its own norm and LM head on ``draft_hidden [N, H]``:
        ``(logits [N, V_draft] fp32, draft_token_ids [V_draft] int64)``."""
        return self.lm_head(self.norm(draft_hidden)).float(), self.draft_token_ids()

    def _rename_layer(self, name: str) -> str:
        if name.startswith("layers.0."):
            return "midlayer." + name[len("layers.0."):]
        return name

    @torch.no_grad()
    def start_from_target(self, draft_token_ids: torch.Tensor | None) -> None:
        """Start from the target where shapes allow: ``norm`` is the target's final norm,
        the LM head the target's rows of the draft ids, and ``fc`` passes the high layer's
        input through (``[0 | 0 | I]``), so the first feature is on the target's scale.

        Args:
            draft_token_ids: ``[V_draft]`` int64 target ids of the draft vocabulary.
        """
        target = self.target
        ids = draft_token_ids.to(target.lm_head.weight.device)
        self.lm_head.weight.copy_(target.lm_head.weight[ids])
        self.norm.weight.copy_(target.model.norm.weight)
        hidden = self.cfg.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * hidden:].copy_(torch.eye(hidden))
