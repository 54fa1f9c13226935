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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.config import ModelArchConfig
from pdserve.engine.models.llama import (  # noqa: I001
    _STACKED_PARAMS as _FUSED_SHARDS,  # checkpoint fragment -> (our fused fragment, shard)
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
)
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import rope_from_hf_config

EAGLE_LAYOUTS = ("eagle1", "eagle3")
#: Names of the weights file of a head folder, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high target layers when a checkpoint names none: ``(2, L//2, L-3)``.

    Ids follow the ``aux_layer_ids`` convention of
    :meth:`pdserve.engine.models.llama.LlamaModel.forward` (the input of layer ``i``).
    """
    return (2, num_target_layers // 2, num_target_layers - 3)


def _int_field(hf: dict, name: str, default: int | None = None) -> int:
    """``hf[name]`` as an int (``default`` when absent or null).

    Raises:
        ValueError: naming the field, when it is required and absent, or not an integer.
    """
    value = hf.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"EAGLE config.json is missing required field {name!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"EAGLE config.json field {name!r} must be an integer, got {value!r}")
    return int(value)


def _detect_layout(hf: dict) -> str:
    """``eagle_layout`` if given, else eagle3 for an ``*Eagle3*`` architecture or a draft vocab."""
    if "eagle_layout" in hf:
        return str(hf["eagle_layout"])
    archs = [str(a).lower() for a in hf.get("architectures") or []]
    if any("eagle3" in a for a in archs) or hf.get("draft_vocab_size") is not None:
        return "eagle3"
    return "eagle1"


@dataclass(frozen=True)
class EagleConfig:
    """Architecture of an EAGLE head, parsed from its ``config.json``; validated.

    Attributes:
        layout: ``"eagle1"`` (EAGLE-1/2 heads) or ``"eagle3"``.
        hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps:
            the draft decoder layer.
        draft_vocab_size: eagle3: rows of its own LM head (None: eagle1).
        aux_layer_ids: eagle3: target layers whose inputs are fused (low, mid, high); empty
            means :func:`default_aux_layer_ids` of the target (resolved at load).
        has_fc_bias: whether ``fc`` has a bias (EAGLE-1/2 checkpoints do).
        target_hidden_size: eagle3: width of each fused target feature (default
            ``hidden_size``).
        hf_config: the whole ``config.json`` (rope settings, provenance).

    Raises:
        ValueError: naming the field, for a missing or inconsistent value.
    """

    layout: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    draft_vocab_size: int | None = None
    aux_layer_ids: tuple[int, ...] = ()
    has_fc_bias: bool = False
    target_hidden_size: int | None = None
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.layout not in EAGLE_LAYOUTS:
            raise ValueError(f"eagle_layout must be one of {EAGLE_LAYOUTS}, got {self.layout!r}")
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if self.layout == "eagle3":
            if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size <= 0:
                raise ValueError("draft_vocab_size must be a positive integer for an eagle3 head, "
                                 f"got {self.draft_vocab_size!r}")
            if self.aux_layer_ids and (len(self.aux_layer_ids) != 3
                                       or min(self.aux_layer_ids) < 0):
                raise ValueError("eagle_aux_hidden_state_layer_ids must be 3 non-negative layer "
                                 f"ids (low, mid, high), got {list(self.aux_layer_ids)}")
        elif self.draft_vocab_size is not None or self.aux_layer_ids:
            raise ValueError("draft_vocab_size / aux layer ids are eagle3 fields; this config "
                             "has eagle_layout 'eagle1'")

    @classmethod
    def from_dict(cls, hf: dict) -> "EagleConfig":
        """Parse a head's ``config.json`` dict (official EAGLE or pdserve-trained).

        Raises:
            ValueError: naming the missing or bad field.
        """
        if hf.get("norm_before_residual"):
            raise ValueError("norm_before_residual=true EAGLE-3 heads are not supported")
        if int(hf.get("num_hidden_layers", 1)) != 1:
            raise ValueError("num_hidden_layers must be 1 for an EAGLE head, got "
                             f"{hf['num_hidden_layers']!r}")
        layout = _detect_layout(hf)
        num_heads = _int_field(hf, "num_attention_heads")
        hidden = _int_field(hf, "hidden_size")
        aux = hf.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        draft_vocab = None
        if layout == "eagle3":
            key = "draft_vocab_size" if hf.get("draft_vocab_size") is not None else "vocab_size"
            draft_vocab = _int_field(hf, key)
        try:
            aux_ids = tuple(int(i) for i in aux or ()) if layout == "eagle3" else ()
            eps = float(hf.get("rms_norm_eps", 1e-6))
        except (TypeError, ValueError):
            raise ValueError("eagle_aux_hidden_state_layer_ids must be integers and rms_norm_eps "
                             "a number") from None
        return cls(
            layout=layout,
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=_int_field(hf, "num_key_value_heads", num_heads),
            head_dim=_int_field(hf, "head_dim", hidden // num_heads),
            intermediate_size=_int_field(hf, "intermediate_size"),
            rms_norm_eps=eps,
            draft_vocab_size=draft_vocab,
            aux_layer_ids=aux_ids,
            has_fc_bias=bool(hf.get("fc_bias", layout == "eagle1")),
            target_hidden_size=_int_field(hf, "target_hidden_size", 0) or None,
            hf_config=hf,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "EagleConfig":
        """Read ``<path>/config.json``.

        Raises:
            FileNotFoundError: the folder or its config.json does not exist.
            ValueError: the file is not valid JSON or a field is missing or bad.
        """
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"speculative model folder {str(folder)!r} does not exist")
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"speculative model folder {str(folder)!r} has no config.json")
        try:
            hf = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
        if not isinstance(hf, dict):
            raise ValueError(f"{config_file} must hold a JSON object")
        return cls.from_dict(hf)

    @property
    def fc_input_size(self) -> int:
        """Input width of ``fc``: ``2H`` (eagle1: embedding ; feature), ``3 * H_target`` (eagle3)."""
        if self.layout == "eagle1":
            return 2 * self.hidden_size
        return 3 * (self.target_hidden_size or self.hidden_size)

    def arch_config(self, vocab_size: int) -> ModelArchConfig:
        """The draft layer's facts in the form our Llama layers take."""
        hf = dict(self.hf_config)
        hf.setdefault("mlp_bias", False)
        return ModelArchConfig(
            architecture="LlamaForCausalLM", vocab_size=vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=False, attention_bias=bool(hf.get("attention_bias", False)),
            eos_token_ids=(), bos_token_id=None, hf_config=hf,
        )


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
        if cfg.layout == "eagle1":
            self.layers = nn.ModuleList([layer])
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

    def compute_logits(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        """``draft_hidden [N, H] -> logits [N, target_vocab]`` fp32 over target token ids.

        eagle1: the target's LM head. eagle3: its own LM head over the draft vocabulary,
        scattered to target ids ``draft_id + d2t[draft_id]``; every other target id is
        ``-inf`` (never drafted).
        """
        if self.cfg.layout == "eagle1":
            return self.target.compute_logits(draft_hidden)
        draft_logits = self.lm_head(self.norm(draft_hidden)).float()  # [N, V_draft]
        ids = torch.arange(draft_logits.shape[-1], device=draft_logits.device) + self.d2t
        out = draft_logits.new_full((draft_logits.shape[0], self.target_vocab_size),
                                    float("-inf"))
        out[:, ids] = draft_logits
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
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (official EAGLE names) into this module.

        ``embed_tokens.*`` is skipped (shared with the target); q/k/v and gate/up go into
        the fused projections; ``d2t``/``t2d`` into their buffers.

        Returns:
            Our parameter and buffer names that were written.

        Raises:
            ValueError: for an unknown tensor name, a shape mismatch, or (eagle3) a draft
                vocabulary smaller than the target's without ``d2t``; and for any parameter
                the checkpoint did not provide.
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
        if self.cfg.layout == "eagle3":
            self._check_vocab_maps(loaded)
        return loaded

    def _check_vocab_maps(self, loaded: set[str]) -> None:
        """eagle3: derive/validate ``d2t``/``t2d`` (identity when the vocabularies agree)."""
        if "d2t" not in loaded and self.cfg.draft_vocab_size != self.target_vocab_size:
            raise ValueError(f"EAGLE-3 checkpoint has draft_vocab_size {self.cfg.draft_vocab_size} "
                             f"< target vocab {self.target_vocab_size} but no 'd2t' map")
        target_ids = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= self.target_vocab_size:
            raise ValueError("EAGLE-3 'd2t' maps draft ids outside the target vocabulary")
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


def _iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
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
    weights = list(_iter_checkpoint(folder))
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
