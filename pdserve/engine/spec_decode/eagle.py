"""EAGLE draft heads: one decoder layer that extrapolates the target model's features.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty") drafts at the feature level: from the target's feature ``f_p`` at position
``p`` and the token ``t_{p+1}`` sampled from it, a single decoder layer predicts the
feature ``f_{p+1}``; the target's LM head turns it into the next draft token, and the
predicted feature is fed back for the following draft step. EAGLE-2 (Li et al. 2024,
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees") keeps the
EAGLE-1 head and changes only how drafts are expanded. EAGLE-3 (Li et al. 2025,
"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test") fuses low/mid/high target layers into the feature and predicts tokens of its own
smaller vocabulary.

Two checkpoint layouts, as published by the EAGLE authors (``config.json`` plus
``model.safetensors`` or ``pytorch_model.bin``)::

    eagle1 (EAGLE-1/2)                        eagle3 (EAGLE-3)
    ------------------                        ----------------
    fc.weight [H, 2H] (+ fc.bias [H])         fc.weight [H, 3*H_target]
    layers.0.self_attn.{q,k,v,o}_proj         midlayer.{hidden_norm,input_layernorm,
    layers.0.mlp.{gate,up,down}_proj                    post_attention_layernorm}.weight
    layers.0.post_attention_layernorm         midlayer.self_attn.{q,k,v}_proj [*, 2H]
    (no input_layernorm, no final norm;       midlayer.self_attn.o_proj, midlayer.mlp.*
     embed_tokens, if present, is ignored)    norm.weight, lm_head.weight [V_draft, H]
                                              d2t [V_draft] int64, t2d [V_target] bool

Data flow of one draft step (``N`` tokens; ``e = embed(token at p+1)``, ``h`` = feature at
``p``)::

    eagle1:  x = fc([e ; h]);  x += attn(x);  x += mlp(norm(x))         -> h' (= f_{p+1})
             logits = target.lm_head(h')
    eagle3:  r = h;  x = [norm(e) ; hidden_norm(h)] (2H);  r += attn(x);
             r += mlp(norm(r))                                           -> h'
             logits over draft ids = lm_head(norm(h')); target id = draft id + d2t[draft id]

``h`` is ``combine_target_hidden(target features)`` for the first draft step and the
draft's own previous output for chained steps.

An eagle1 head may also carry a frequency-ranked draft vocabulary (FR-Spec, Zhao et al.
2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling"): ``draft_vocab_size`` in its config and a ``d2t [V_draft]`` map
(EAGLE-3's convention). It then drafts only over those target ids, through the matching
rows of the shared LM head: on a small model the LM head is most of a draft step's cost
(SmolLM2-135M: 49,152 x 576 against 3.5M weights in the layer). Verification is
unchanged, so output stays the target's; only tokens outside the draft vocabulary can
no longer be drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.config import ModelArchConfig
from pdserve.engine.spec_decode.eagle_config import (
    EAGLE_LAYOUTS,
    EagleConfig,
    default_aux_layer_ids,
)
from pdserve.engine.models.llama import (  # noqa: I001
    _STACKED_PARAMS as _FUSED_SHARDS,  # checkpoint fragment -> (our fused fragment, shard)
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
)
from pdserve.engine.layers.linear import cpu_linear
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import rope_from_hf_config

__all__ = [
    "EAGLE_LAYOUTS", "WEIGHT_FILES", "EagleConfig", "EagleDecoderLayer", "EagleDraftModel",
    "bundled_head_dir", "default_aux_layer_ids", "iter_checkpoint", "load_eagle_model",
]

#: Names of the weights file of a head folder, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class EagleDecoderLayer(nn.Module):
    """The draft's single decoder layer (Llama block; see the module docstring for the wiring).

    eagle1 has no ``input_layernorm`` (the fc output enters attention directly); eagle3 has
    ``hidden_norm`` for the feature and ``input_layernorm`` for the embedding, and its
    Q/K/V projections read their concatenation (``2H`` wide).
    """

    def __init__(self, cfg: EagleConfig, arch: ModelArchConfig, backend: AttentionBackend,
                 max_position: int) -> None:
        super().__init__()
        rotary = rope_from_hf_config(arch.hf_config, cfg.head_dim, max_position)
        self.self_attn = LlamaAttention(arch, rotary, backend)
        self.mlp = LlamaMLP(arch)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_eagle3 = cfg.layout == "eagle3"
        if self.is_eagle3:
            attn = self.self_attn
            attn.qkv_proj = nn.Linear(2 * cfg.hidden_size, attn.q_size + 2 * attn.kv_size,
                                      bias=arch.attention_bias)
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                kv_cache: KVCache, attn_metadata: Any) -> torch.Tensor:
        """``embeds`` (eagle3) or ``fc`` output (eagle1) ``[N, H]``, ``hidden [N, H]`` -> ``[N, H]``.

        eagle1 passes the fc output as ``hidden`` and ignores ``embeds``.
        """
        self.self_attn.rotary.forget()
        if self.is_eagle3:
            residual = hidden
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        else:
            residual = x = hidden
        x = self.self_attn(positions, x, kv_cache, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


@dataclass(frozen=True)
class _SharedTarget:
    """The target model, held by reference so its weights are neither owned nor saved."""

    model: LlamaForCausalLM


class EagleDraftModel(nn.Module):
    """One decoder layer over the target's features (EAGLE-1/2 or EAGLE-3 layout).

    Shares ``target.model.embed_tokens`` and (eagle1) the target's LM head; they are not
    parameters of this module (``state_dict`` and ``parameters()`` hold only the head).

    Args:
        cfg: the head's architecture.
        target: the target model (a :class:`LlamaForCausalLM` or subclass).
        backend: the attention backend (one for the draft's own one-layer paged cache).
        max_position: rotary table length (positions must be below it).

    Attributes:
        num_layers, num_kv_heads, head_dim: to allocate the draft's paged KV cache
            (``num_layers`` is 1), ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        aux_layer_ids: eagle3: the target layers to pass as ``aux_layer_ids`` to the target's
            forward; empty for eagle1.

    Raises:
        ValueError: the head does not fit the target (hidden sizes, layer ids, vocab).
    """

    num_layers = 1

    def __init__(self, cfg: EagleConfig, target: LlamaForCausalLM, backend: AttentionBackend,
                 max_position: int) -> None:
        super().__init__()
        tcfg = target.cfg
        if cfg.layout == "eagle1" and cfg.hidden_size != tcfg.hidden_size:
            raise ValueError(f"EAGLE head hidden_size {cfg.hidden_size} differs from the target's "
                             f"{tcfg.hidden_size}; an eagle1 head shares its embedding and LM head")
        if cfg.layout == "eagle3":
            if (cfg.target_hidden_size or cfg.hidden_size) != tcfg.hidden_size:
                raise ValueError(f"EAGLE-3 head fuses features of width "
                                 f"{cfg.target_hidden_size or cfg.hidden_size}; the target's "
                                 f"hidden_size is {tcfg.hidden_size}")
            if cfg.hidden_size != tcfg.hidden_size:
                raise ValueError(f"EAGLE-3 head hidden_size {cfg.hidden_size} differs from the "
                                 f"target's embedding width {tcfg.hidden_size}")
            if cfg.draft_vocab_size > tcfg.vocab_size:
                raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} exceeds the target's "
                                 f"vocab_size {tcfg.vocab_size}")
            aux = cfg.aux_layer_ids or default_aux_layer_ids(tcfg.num_layers)
            if max(aux) >= tcfg.num_layers or min(aux) < 0:
                raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(aux)} are not layers of "
                                 f"the target (0 .. {tcfg.num_layers - 1})")
            cfg = replace(cfg, aux_layer_ids=tuple(aux))
        self.cfg = cfg
        self.aux_layer_ids = cfg.aux_layer_ids
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.target_vocab_size = tcfg.vocab_size
        self._shared = _SharedTarget(target)
        arch = cfg.arch_config(tcfg.vocab_size)
        self.fc = nn.Linear(cfg.fc_input_size, cfg.hidden_size, bias=cfg.has_fc_bias)
        layer = EagleDecoderLayer(cfg, arch, backend, max_position)
        self._draft_lm_head: torch.Tensor | None = None  # eagle1 + draft vocab, built lazily
        if cfg.layout == "eagle1":
            self.layers = nn.ModuleList([layer])
            if cfg.draft_vocab_size is not None:
                if cfg.draft_vocab_size > tcfg.vocab_size:
                    raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} exceeds the "
                                     f"target's vocab_size {tcfg.vocab_size}")
                self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size,
                                                        dtype=torch.int64))
                self.register_buffer("t2d", torch.zeros(tcfg.vocab_size, dtype=torch.bool))
        else:
            self.midlayer = layer
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
            # target id = draft id + d2t[draft id]; t2d[target id] = is in the draft vocab.
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(tcfg.vocab_size, dtype=torch.bool))

    @property
    def layer(self) -> EagleDecoderLayer:
        """The single decoder layer (``layers.0`` for eagle1, ``midlayer`` for eagle3)."""
        return self.layers[0] if self.cfg.layout == "eagle1" else self.midlayer

    @property
    def target(self) -> LlamaForCausalLM:
        """The target model whose embedding (and eagle1: LM head) this head shares."""
        return self._shared.model

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
        if self.cfg.layout == "eagle1":
            return target_hidden
        return self.fc(target_hidden)

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
        embeds = self.target.model.embed_tokens(input_ids).to(hidden.dtype)
        layer = self.layer
        if self.cfg.layout == "eagle1":
            x = self.fc(torch.cat([embeds, hidden], dim=-1))
            return layer(positions, embeds, x, kv_caches[0], attn_metadata)
        return layer(positions, embeds, hidden, kv_caches[0], attn_metadata)

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

    def compute_draft_logits(self, draft_hidden: torch.Tensor,
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the draft vocabulary only (the cheap path for drafting).

        Args:
            draft_hidden: ``[N, H]`` this module's output.

        Returns:
            ``(logits [N, V_draft] fp32, draft_token_ids [V_draft] int64)``; without a draft
            vocabulary ``(logits [N, target_vocab], None)``.
        """
        if self.cfg.layout == "eagle3":
            return self.lm_head(self.norm(draft_hidden)).float(), self.draft_token_ids()
        if not self.has_draft_vocab:
            return self.target.compute_logits(draft_hidden), None
        if self._draft_lm_head is None:
            # FR-Spec: the shared LM head's rows of the draft ids, gathered once (the target's
            # weights are frozen while serving). A head without a dense weight (a quantized
            # LM head) falls back to slicing full logits.
            weight = getattr(self.target.lm_head, "weight", None)
            ids = self.draft_token_ids()
            self._draft_lm_head = (weight.detach()[ids].contiguous()
                                   if isinstance(weight, torch.Tensor) else torch.empty(0))
        if self._draft_lm_head.numel() == 0:
            return self.target.compute_logits(draft_hidden)[:, self.draft_token_ids()], \
                self.draft_token_ids()
        w = self._draft_lm_head
        gemm = cpu_linear if w.device.type == "cpu" else F.linear
        return gemm(draft_hidden.to(w.dtype), w).float(), self.draft_token_ids()

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

    def _fused_shard(self, fused: str, index: int) -> tuple[int, int]:
        """``(start, size)`` rows of shard ``index`` inside a fused projection."""
        cfg = self.cfg
        if fused == ".qkv_proj.":
            kv = cfg.num_kv_heads * cfg.head_dim
            sizes = [cfg.num_heads * cfg.head_dim, kv, kv]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        return sum(sizes[:index]), sizes[index]

    def _our_name(self, name: str) -> str | None:
        """Checkpoint name -> our name (fused q/k/v and gate/up aside); None to skip it."""
        if name.startswith("model."):
            name = name[len("model."):]
        if name.startswith("embed_tokens."):
            return None  # shared with the target
        if self.cfg.layout == "eagle3" and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
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
            name = self._our_name(raw_name)
            if name is None:
                continue
            shard = None
            for frag, fused, index in _FUSED_SHARDS:
                if frag in name:
                    name, shard = name.replace(frag, fused), self._fused_shard(fused, index)
                    break
            if name in ("d2t", "t2d") and not require_vocab_map:
                continue
            if name not in tensors:
                raise ValueError(f"EAGLE checkpoint tensor {raw_name!r} has no matching parameter "
                                 f"in a {self.cfg.layout} head")
            dest = tensors[name].data
            if shard is not None:
                dest = dest.narrow(0, shard[0], shard[1])
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

    def _check_vocab_maps(self, loaded: set[str]) -> None:
        """Derive/validate ``d2t``/``t2d`` (identity when the vocabularies agree)."""
        self._draft_lm_head = None
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


def bundled_head_dir(model_name: str) -> Path | None:
    """The EAGLE head shipped with pdserve for a target model, or None if there is none.

    Args:
        model_name: the target's folder name, e.g. ``"SmolLM2-135M-Instruct"``.

    Returns:
        ``pdserve/data/eagle/<lowercased name>`` when it holds a ``config.json``.
    """
    from importlib import resources

    folder = Path(str(resources.files("pdserve.data"))) / "eagle" / model_name.lower()
    return folder if (folder / "config.json").is_file() else None


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of ``model.safetensors`` (or ``pytorch_model.bin``, loaded weights-only)."""
    for filename in WEIGHT_FILES:
        path = folder / filename
        if not path.is_file():
            continue
        if filename.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        else:
            yield from torch.load(path, map_location="cpu", weights_only=True).items()
        return
    raise FileNotFoundError(f"speculative model folder {str(folder)!r} has no weights "
                            f"(looked for {', '.join(WEIGHT_FILES)})")


def load_eagle_model(path: str | Path, target: LlamaForCausalLM, backend: AttentionBackend,
                     max_position: int, dtype: torch.dtype) -> EagleDraftModel:
    """Build and load the EAGLE head in folder ``path`` for ``target`` (``--speculative-model``).

    Args:
        path: a folder with ``config.json`` and ``model.safetensors`` / ``pytorch_model.bin``.
        target: the loaded target model (its device is used).
        backend: attention backend for the draft's paged KV cache.
        max_position: longest position the draft will see (+1).
        dtype: parameter dtype of the head (``d2t``/``t2d`` keep int64/bool).

    Returns:
        The head in eval mode.

    Raises:
        FileNotFoundError: the folder, its config.json or its weights file is missing.
        ValueError: a bad config, a head that does not fit the target, or bad tensors.
    """
    folder = Path(path).expanduser()
    cfg = EagleConfig.from_dir(folder)
    weights = list(iter_checkpoint(folder))
    names = {name for name, _ in weights}
    if cfg.layout == "eagle1":
        cfg = replace(cfg, has_fc_bias="fc.bias" in names or "model.fc.bias" in names)
    device = next(target.parameters()).device
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = EagleDraftModel(cfg, target, backend, max_position)
    finally:
        torch.set_default_dtype(old_dtype)
    model.load_weights(weights)
    return model.eval()
