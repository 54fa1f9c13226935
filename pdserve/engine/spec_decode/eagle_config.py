"""Configuration of an EAGLE draft head, parsed from its ``config.json``.

Reads both the official EAGLE checkpoints' configs (a Llama ``config.json`` with one
layer; EAGLE-3: ``LlamaForCausalLMEagle3`` with ``draft_vocab_size`` and optionally
``eagle_aux_hidden_state_layer_ids``) and the ones ``pdserve train-eagle`` writes
(``eagle_layout`` plus provenance). See :mod:`pdserve.engine.spec_decode.eagle`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.engine.config import ModelArchConfig

EAGLE_LAYOUTS = ("eagle1", "eagle3")


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
        draft_vocab_size: eagle3: rows of its own LM head. eagle1: None (drafts over the
            target's whole vocabulary) or the size of a frequency-ranked draft vocabulary
            (FR-Spec, Zhao et al. 2025): the head's ``d2t`` map picks that many rows of the
            shared LM head, so each draft step's LM head costs ``draft_vocab_size / vocab``.
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
        elif self.aux_layer_ids:
            raise ValueError("aux layer ids are an eagle3 field; this config has eagle_layout "
                             "'eagle1'")
        elif self.draft_vocab_size is not None and (
                not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size <= 0):
            raise ValueError("draft_vocab_size must be a positive integer, got "
                             f"{self.draft_vocab_size!r}")

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
        elif hf.get("draft_vocab_size") is not None:  # frequency-ranked draft vocabulary
            draft_vocab = _int_field(hf, "draft_vocab_size")
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
