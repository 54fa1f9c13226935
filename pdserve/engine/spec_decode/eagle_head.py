"""What every EAGLE head does, whatever its layout: the base of :mod:`.eagle1_head` and
:mod:`.eagle3_head` (see :mod:`pdserve.engine.spec_decode.eagle` for both layouts).

A head shares the target's embedding (and, eagle1, its LM head) by reference; it maps
draft ids to target ids with ``d2t`` when it drafts over a draft vocabulary, and loads
official EAGLE checkpoints, whose q/k/v and gate/up projections are separate tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.config import ModelArchConfig
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import rope_from_hf_config
from pdserve.engine.models.llama import (  # noqa: I001
    _STACKED_PARAMS as _FUSED_SHARDS,  # checkpoint fragment -> (our fused fragment, shard)
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
)
from pdserve.engine.spec_decode.eagle_config import EagleConfig


class EagleDecoderLayer(nn.Module, ABC):
    """The draft's single decoder layer (a Llama block); its subclasses say what enters
    attention (see the module docstring of :mod:`pdserve.engine.spec_decode.eagle`)."""

    def __init__(self, cfg: EagleConfig, arch: ModelArchConfig, backend: AttentionBackend,
                 max_position: int) -> None:
        super().__init__()
        rotary = rope_from_hf_config(arch.hf_config, cfg.head_dim, max_position)
        self.self_attn = LlamaAttention(arch, rotary, backend)
        self.mlp = LlamaMLP(arch)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @abstractmethod
    def _attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention input, residual)`` of the layer's inputs."""

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                kv_cache: KVCache, attn_metadata: Any) -> torch.Tensor:
        """``embeds`` (eagle3) or ``fc`` output (eagle1) ``[N, H]``, ``hidden [N, H]`` -> ``[N, H]``.

        eagle1 passes the fc output as ``hidden`` and ignores ``embeds``.
        """
        self.self_attn.rotary.forget()
        x, residual = self._attention_input(embeds, hidden)
        x = self.self_attn(positions, x, kv_cache, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


def check_draft_vocab_fits(cfg: EagleConfig, target: ModelArchConfig) -> None:
    """Refuse a head whose draft vocabulary is larger than the target's vocabulary.

    Raises:
        ValueError: naming both sizes.
    """
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > target.vocab_size:
        raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} exceeds the target's "
                         f"vocab_size {target.vocab_size}")


@dataclass(frozen=True)
class _SharedTarget:
    """The target model, held by reference so its weights are neither owned nor saved."""

    model: LlamaForCausalLM


class EagleDraftModel(nn.Module, ABC):
    """One decoder layer over the target's features: the interface of both layouts
    (:class:`~.eagle1_head.Eagle1DraftModel`, :class:`~.eagle3_head.Eagle3DraftModel`;
    :func:`~pdserve.engine.spec_decode.eagle.build_eagle_head` builds the one a config
    names).

    Shares ``target.model.embed_tokens`` and (eagle1) the target's LM head; they are not
    parameters of this module (``state_dict`` and ``parameters()`` hold only the head).

    Args:
        cfg: the head's architecture.
        target: the target model (a :class:`LlamaForCausalLM` or subclass).
        backend: the attention backend (one for the draft's own one-layer paged cache).
        max_position: rotary table length (positions must be below it).

    Attributes:
        cfg: ``cfg`` fitted to the target (:meth:`_fit_target`).
        num_layers, num_kv_heads, head_dim: to allocate the draft's paged KV cache
            (``num_layers`` is 1), ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        aux_layer_ids: eagle3: the target layers to pass as ``aux_layer_ids`` to the target's
            forward; empty for eagle1.
        config_class: (class) the config class of the layout this head class implements.

    Raises:
        ValueError: the head does not fit the target (hidden sizes, layer ids, vocab).
    """

    num_layers = 1
    config_class: type[EagleConfig]

    def __init__(self, cfg: EagleConfig, target: LlamaForCausalLM, backend: AttentionBackend,
                 max_position: int) -> None:
        super().__init__()
        cfg = self._fit_target(cfg, target.cfg)
        self.cfg = cfg
        self.aux_layer_ids = cfg.aux_layer_ids
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.target_vocab_size = target.cfg.vocab_size
        self._shared = _SharedTarget(target)
        self.fc = nn.Linear(cfg.fc_input_size, cfg.hidden_size, bias=cfg.has_fc_bias)

    @staticmethod
    @abstractmethod
    def _fit_target(cfg: EagleConfig, target: ModelArchConfig) -> EagleConfig:
        """``cfg`` checked against the target, with what depends on it resolved.

        Raises:
            ValueError: the head does not fit the target.
        """

    def _register_vocab_maps(self) -> None:
        """Zeroed ``d2t [V_draft]`` int64 and ``t2d [V_target]`` bool buffers (loaded later).

        ``target id = draft id + d2t[draft id]``; ``t2d[target id]``: in the draft vocab.
        """
        self.register_buffer("d2t", torch.zeros(self.cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(self.target_vocab_size, dtype=torch.bool))

    @property
    @abstractmethod
    def layer(self) -> EagleDecoderLayer:
        """The single decoder layer (``layers.0`` for eagle1, ``midlayer`` for eagle3)."""

    @property
    def target(self) -> LlamaForCausalLM:
        """The target model whose embedding (and eagle1: LM head) this head shares."""
        return self._shared.model

    @abstractmethod
    def combine_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The first draft step's feature from the target's output.

        Args:
            target_hidden: eagle1: ``[N, H]`` the target's final (normed) hidden states;
                eagle3: ``[N, 3 * H]`` the aux output of the target's forward with
                ``aux_layer_ids=self.aux_layer_ids``. Model dtype.

        Returns:
            ``[N, H]`` in the model dtype: eagle1 returns its input unchanged, eagle3
            ``fc(target_hidden)``.
        """

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: Any) -> torch.Tensor:
        """One draft step for ``N`` tokens (any mix of requests, as the backend's metadata says).

        Args:
            input_ids: ``[N]`` int64, the token at position ``p + 1``.
            hidden: ``[N, H]`` model dtype, the feature at ``p`` (from
                :meth:`combine_target_hidden`, or this module's previous output when chaining).
            positions: ``[N]`` int64, ``p`` (the draft's KV for this token goes to the slot
                of ``p`` in ``attn_metadata``).
            kv_caches: one ``(k_cache, v_cache)``, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]`` (written in place).
            attn_metadata: the backend's metadata for these ``N`` tokens.

        Returns:
            ``[N, H]``: the predicted feature of position ``p + 1`` (eagle3: before the final
            norm), to feed back as ``hidden`` and to pass to :meth:`compute_logits`.
        """

    def start_from_target(self, draft_token_ids: torch.Tensor | None) -> None:
        """Start a new (randomly initialized) head from the target where shapes allow.

        An eagle1 head shares what it could take from the target; nothing to do.

        Args:
            draft_token_ids: ``[V_draft]`` int64 target ids of the draft vocabulary, or None.
        """

    @property
    def has_draft_vocab(self) -> bool:
        """Whether drafts are restricted to a draft vocabulary (eagle3, or eagle1 + FR-Spec)."""
        return self.cfg.draft_vocab_size is not None

    def draft_token_ids(self) -> torch.Tensor:
        """``[V_draft]`` int64: the target id of each draft id (``arange + d2t``).

        Raises:
            ValueError: the head has no draft vocabulary.
        """
        if not self.has_draft_vocab:
            raise ValueError("this EAGLE head drafts over the whole target vocabulary")
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    @abstractmethod
    def compute_draft_logits(self, draft_hidden: torch.Tensor,
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the draft vocabulary only (the cheap path for drafting).

        Args:
            draft_hidden: ``[N, H]`` this module's output.

        Returns:
            ``(logits [N, V_draft] fp32, draft_token_ids [V_draft] int64)``; without a draft
            vocabulary ``(logits [N, target_vocab], None)``.
        """

    def compute_logits(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        """``draft_hidden [N, H] -> logits [N, target_vocab]`` fp32 over target token ids.

        eagle1: the target's LM head (or, with a draft vocabulary, its draft rows). eagle3:
        its own LM head over the draft vocabulary. With a draft vocabulary the logits are
        scattered to target ids ``draft_id + d2t[draft_id]``; every other target id is
        ``-inf`` (never drafted).
        """
        logits, ids = self.compute_draft_logits(draft_hidden)
        if ids is None:
            return logits
        out = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        out[:, ids] = logits
        return out

    def fused_shard(self, fused: str, index: int) -> tuple[int, int]:
        """``(start, size)`` rows of shard ``index`` (q, k, v or gate, up) inside the fused
        projection ``fused`` (``".qkv_proj."`` or ``".gate_up_proj."``)."""
        cfg = self.cfg
        if fused == ".qkv_proj.":
            kv = cfg.num_kv_heads * cfg.head_dim
            sizes = [cfg.num_heads * cfg.head_dim, kv, kv]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        return sum(sizes[:index]), sizes[index]

    def own_tensor_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> ours, before fusing q/k/v and gate/up; None to skip it
        (``embed_tokens``, shared with the target). A leading ``model.`` is dropped."""
        name = name.removeprefix("model.")
        if name.startswith("embed_tokens."):
            return None
        return self._rename_layer(name)

    def _rename_layer(self, name: str) -> str:
        """The decoder layer's checkpoint prefix as this layout names its module."""
        return name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     require_vocab_map: bool = True) -> set[str]:
        """Copy checkpoint tensors (official EAGLE names) into this module.

        ``embed_tokens.*`` is skipped (shared with the target); q/k/v and gate/up go into
        the fused projections; ``d2t``/``t2d`` into their buffers.

        Returns:
            Our parameter and buffer names that were written.

        Raises:
            ValueError: for an unknown tensor name, a shape mismatch, or a draft
                vocabulary smaller than the target's without ``d2t`` (unless
                ``require_vocab_map`` is False: the caller sets ``d2t`` itself, as
                ``train-eagle --init-from`` does); and for any parameter the checkpoint did
                not provide.
        """
        tensors = dict(self.named_parameters())
        tensors.update(self.named_buffers())
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = self.own_tensor_name(raw_name)
            if name is None or (name in ("d2t", "t2d") and not require_vocab_map):
                continue
            name, dest = self._destination(raw_name, name, tensors)
            if dest.shape != tensor.shape:
                raise ValueError(f"EAGLE checkpoint tensor {raw_name!r} has shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor.to(dest.dtype))
            loaded.add(name)
        missing = set(dict(self.named_parameters())) - loaded
        if missing:
            raise ValueError(f"EAGLE checkpoint is missing tensors: {sorted(missing)[:5]}")
        if self.has_draft_vocab and require_vocab_map:
            self._check_vocab_maps(loaded)
        return loaded

    def _destination(self, raw_name: str, name: str, tensors: dict[str, torch.Tensor],
                     ) -> tuple[str, torch.Tensor]:
        """Our tensor name for checkpoint tensor ``raw_name`` (``name`` before fusing) and
        the rows of our tensor it fills.

        Raises:
            ValueError: no tensor of this head has that name.
        """
        shard = None
        for frag, fused, index in _FUSED_SHARDS:
            if frag in name:
                name, shard = name.replace(frag, fused), self.fused_shard(fused, index)
                break
        if name not in tensors:
            raise ValueError(f"EAGLE checkpoint tensor {raw_name!r} has no matching parameter "
                             f"in a {self.cfg.layout} head")
        dest = tensors[name].data
        if shard is not None:
            dest = dest.narrow(0, shard[0], shard[1])
        return name, dest

    def _check_vocab_maps(self, loaded: set[str]) -> None:
        """Derive/validate ``d2t``/``t2d`` (identity when the vocabularies agree)."""
        if "d2t" not in loaded and self.cfg.draft_vocab_size != self.target_vocab_size:
            raise ValueError(f"EAGLE checkpoint has draft_vocab_size {self.cfg.draft_vocab_size} "
                             f"< target vocab {self.target_vocab_size} but no 'd2t' map")
        target_ids = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= self.target_vocab_size:
            raise ValueError("EAGLE 'd2t' maps draft ids outside the target vocabulary")
        if len(target_ids.unique()) != len(target_ids):
            raise ValueError("EAGLE 'd2t' maps two draft ids to the same target id")
        if "t2d" not in loaded:
            self.t2d.zero_()
            self.t2d[target_ids] = True
