"""The EAGLE-1/2 head: ``fc`` over ``[embedding ; target feature]``, the target's LM head.

Official names: ``fc.weight [H, 2H]`` (+ ``fc.bias``), ``layers.0.self_attn.*``,
``layers.0.mlp.*``, ``layers.0.post_attention_layernorm``; no input norm, no final norm.
With a frequency-ranked draft vocabulary (FR-Spec) also ``d2t``/``t2d``, and drafts go
through those rows of the shared LM head only (see :mod:`pdserve.engine.spec_decode.eagle`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.config import ModelArchConfig
from pdserve.engine.kernels.cpu_gemv import MAX_GEMV_ROWS, bf16_gemv_module, gemv_linear
from pdserve.engine.layers.linear import Fp32GemmLinear, cpu_linear
from pdserve.engine.models.llama import KVCache, LlamaForCausalLM
from pdserve.engine.spec_decode.eagle_config import Eagle1Config, EagleConfig
from pdserve.engine.spec_decode.eagle_head import (
    EagleDecoderLayer,
    EagleDraftModel,
    check_draft_vocab_fits,
)


class Eagle1DecoderLayer(EagleDecoderLayer):
    """eagle1's layer: no ``input_layernorm``; the fc output enters attention directly and
    is the residual."""

    def _attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, hidden


class Eagle1DraftModel(EagleDraftModel):
    """An EAGLE-1/2 head (see :class:`EagleDraftModel` for the interface and arguments)."""

    config_class = Eagle1Config

    def __init__(self, cfg: EagleConfig, target: LlamaForCausalLM, backend: AttentionBackend,
                 max_position: int) -> None:
        super().__init__(cfg, target, backend, max_position)
        arch = self.cfg.arch_config(self.target_vocab_size)
        self.layers = nn.ModuleList([Eagle1DecoderLayer(self.cfg, arch, backend, max_position)])
        # the shared LM head's rows of the draft vocabulary, gathered on first use
        self._draft_lm_head: torch.Tensor | None = None
        if self.cfg.draft_vocab_size is not None:
            self._register_vocab_maps()

    @staticmethod
    def _fit_target(cfg: EagleConfig, target: ModelArchConfig) -> EagleConfig:
        if cfg.hidden_size != target.hidden_size:
            raise ValueError(f"EAGLE head hidden_size {cfg.hidden_size} differs from the "
                             f"target's {target.hidden_size}; an eagle1 head shares its "
                             "embedding and LM head")
        check_draft_vocab_fits(cfg, target)
        return cfg

    @property
    def layer(self) -> Eagle1DecoderLayer:
        """``layers.0``."""
        return self.layers[0]

    def combine_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``target_hidden [N, H]`` itself: the target's final hidden states are the feature."""
        return target_hidden

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: Any) -> torch.Tensor:
        """``fc([embed(input_ids) ; hidden])`` through the layer; see
        :meth:`EagleDraftModel.forward` for the shapes."""
        embeds = self.target.model.embed_tokens(input_ids).to(hidden.dtype)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        return self.layers[0](positions, embeds, x, kv_caches[0], attn_metadata)

    def compute_draft_logits(self, draft_hidden: torch.Tensor,
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's LM head on ``draft_hidden [N, H]``: ``(logits [N, V] fp32, None)``,
        or with a draft vocabulary its rows of the draft ids only:
        ``(logits [N, V_draft] fp32, draft_token_ids [V_draft] int64)``."""
        if not self.has_draft_vocab:
            return self.target.compute_logits(draft_hidden), None
        if self._draft_lm_head is None:
            # FR-Spec: the shared LM head's rows of the draft ids, gathered once (the target's
            # weights are frozen while serving). A head without a dense weight (a quantized
            # LM head) falls back to slicing full logits. Where the target's GEMMs run in
            # fp32 for a bf16 model (no native bf16), the rows of its bf16 copy (bf16 GEMV).
            lm_head = self.target.lm_head
            weight = (lm_head.bf16_weights()[0] if isinstance(lm_head, Fp32GemmLinear)
                      and draft_hidden.dtype == torch.bfloat16
                      else getattr(lm_head, "weight", None))
            ids = self.draft_token_ids()
            self._draft_lm_head = (weight.detach()[ids].contiguous()
                                   if isinstance(weight, torch.Tensor) else torch.empty(0))
        if self._draft_lm_head.numel() == 0:
            return self.target.compute_logits(draft_hidden)[:, self.draft_token_ids()], \
                self.draft_token_ids()
        w = self._draft_lm_head
        if (isinstance(self.target.lm_head, Fp32GemmLinear) and w.dtype == torch.bfloat16
                and draft_hidden.shape[0] <= MAX_GEMV_ROWS and bf16_gemv_module() is not None):
            # draft-sized steps at memory speed: the fp32 rows are twice the bytes (1.47 -> 0.73
            # ms a draft on a 2-core AVX2 EPYC)
            return gemv_linear(draft_hidden.to(w.dtype), w).float(), self.draft_token_ids()
        gemm = cpu_linear if w.device.type == "cpu" else F.linear
        return gemm(draft_hidden.to(w.dtype), w).float(), self.draft_token_ids()

    def _check_vocab_maps(self, loaded: set[str]) -> None:
        self._draft_lm_head = None  # new d2t: gather the LM head rows again
        super()._check_vocab_maps(loaded)
