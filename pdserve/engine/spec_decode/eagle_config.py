"""Configuration of an EAGLE draft head, parsed from its ``config.json``: one class per layout.

Reads both the official EAGLE checkpoints' configs (a Llama ``config.json`` with one
layer; EAGLE-3: ``LlamaForCausalLMEagle3`` with ``draft_vocab_size`` and optionally
``eagle_aux_hidden_state_layer_ids``) and the ones ``pdserve train-eagle`` writes
(``eagle_layout`` plus provenance). See :mod:`pdserve.engine.spec_decode.eagle`.

:class:`Eagle1Config` (EAGLE-1/2) and :class:`Eagle3Config` (EAGLE-3) say what differs
between the layouts, so callers ask the config instead of comparing layout names;
:func:`eagle_config_class` is the one place a layout name becomes a class.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Iterable

from pdserve.engine.config import ModelArchConfig


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
        return Eagle3Config.layout
    return Eagle1Config.layout


@dataclass(frozen=True)
class EagleConfig(ABC):
    """Architecture of an EAGLE head, parsed from its ``config.json``; validated.

    An instance is always of a layout's subclass (:meth:`from_dict` picks it).

    Attributes:
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

    Class attributes (what differs between the layouts):
        layout: ``eagle_layout`` in config.json; name: the paper of the checkpoint layout
            (``"EAGLE-1"``); versions: the EAGLE versions with heads of it (``"EAGLE-1/2"``);
            architecture: the ``architectures`` entry train-eagle writes.
        fuses_target_layers: fed several target layers' inputs (``aux_layer_ids``), not
            the target's final hidden state.
        predicts_target_features: its output predicts the target's next feature (trained
            with feature regression and feature noise).
        has_own_lm_head: its own norm and LM head over its draft vocabulary (else it
            shares the target's); default_fc_bias: ``fc`` bias when config.json is silent.

    Raises:
        ValueError: naming the field, for a missing or inconsistent value.
    """

    layout: ClassVar[str]
    name: ClassVar[str]
    versions: ClassVar[str]
    architecture: ClassVar[str]
    fuses_target_layers: ClassVar[bool]
    predicts_target_features: ClassVar[bool]
    has_own_lm_head: ClassVar[bool]
    default_fc_bias: ClassVar[bool]

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
        self._check_layout_fields()

    @abstractmethod
    def _check_layout_fields(self) -> None:
        """Validate the fields whose rules depend on the layout (draft vocab, aux layers)."""

    @classmethod
    @abstractmethod
    def _parse_draft_vocab_size(cls, hf: dict) -> int | None:
        """The draft vocabulary size config.json gives this layout (None: the whole one)."""

    @classmethod
    @abstractmethod
    def resolve_aux_layer_ids(cls, aux_layer_ids: tuple[int, ...],
                              num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs a head of this layout reads, given the ones a
        config or a user named (empty: none named): eagle3 ``aux_layer_ids`` or
        :func:`default_aux_layer_ids`; eagle1 none (it reads the final hidden state)."""

    @property
    @abstractmethod
    def fc_input_size(self) -> int:
        """Input width of ``fc``: ``2H`` (eagle1: embedding ; feature), ``3 * H_target`` (eagle3)."""

    def fit_checkpoint(self, tensor_names: Iterable[str]) -> "EagleConfig":
        """This config adjusted to what the checkpoint holds (eagle1: ``fc.bias`` or not)."""
        return self

    @classmethod
    def hf_layout_fields(cls, target_hf: dict, draft_vocab_size: int | None,
                         aux_layer_ids: tuple[int, ...]) -> dict:
        """The config.json entries only this layout writes, for a head of ``target_hf``
        (eagle3: ``target_hidden_size``, ``draft_vocab_size``, the fused layers)."""
        return {}

    @classmethod
    @abstractmethod
    def describe_checkpoint(cls, aux_layer_ids: tuple[int, ...]) -> str:
        """Markdown for a trained head's README: the tensor names this layout writes."""

    @classmethod
    def from_dict(cls, hf: dict) -> "EagleConfig":
        """Parse a head's ``config.json`` dict (official EAGLE or pdserve-trained).

        Returns an :class:`Eagle1Config` or :class:`Eagle3Config`, as the dict's layout
        says (whichever class this is called on).

        Raises:
            ValueError: naming the missing or bad field.
        """
        if hf.get("norm_before_residual"):
            raise ValueError("norm_before_residual=true EAGLE-3 heads are not supported")
        if int(hf.get("num_hidden_layers", 1)) != 1:
            raise ValueError("num_hidden_layers must be 1 for an EAGLE head, got "
                             f"{hf['num_hidden_layers']!r}")
        kind = eagle_config_class(_detect_layout(hf))
        num_heads = _int_field(hf, "num_attention_heads")
        hidden = _int_field(hf, "hidden_size")
        aux = hf.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        draft_vocab = kind._parse_draft_vocab_size(hf)
        try:
            aux_ids = tuple(int(i) for i in aux or ()) if kind.fuses_target_layers else ()
            eps = float(hf.get("rms_norm_eps", 1e-6))
        except (TypeError, ValueError):
            raise ValueError("eagle_aux_hidden_state_layer_ids must be integers and rms_norm_eps "
                             "a number") from None
        return kind(
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=_int_field(hf, "num_key_value_heads", num_heads),
            head_dim=_int_field(hf, "head_dim", hidden // num_heads),
            intermediate_size=_int_field(hf, "intermediate_size"),
            rms_norm_eps=eps,
            draft_vocab_size=draft_vocab,
            aux_layer_ids=aux_ids,
            has_fc_bias=bool(hf.get("fc_bias", kind.default_fc_bias)),
            target_hidden_size=_int_field(hf, "target_hidden_size", 0) or None,
            hf_config=hf,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "EagleConfig":
        """Read ``<path>/config.json`` (see :meth:`from_dict`).

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


class Eagle1Config(EagleConfig):
    """An EAGLE-1/2 head: ``fc`` over ``[embedding ; the target's final hidden state]``, the
    target's LM head shared (over all ids, or FR-Spec's draft vocabulary)."""

    layout = "eagle1"
    name = "EAGLE-1"
    versions = "EAGLE-1/2"
    architecture = "LlamaForCausalLM"
    fuses_target_layers = False
    predicts_target_features = True
    has_own_lm_head = False
    default_fc_bias = True

    def _check_layout_fields(self) -> None:
        if self.aux_layer_ids:
            raise ValueError("aux layer ids are an eagle3 field; this config has eagle_layout "
                             "'eagle1'")
        if self.draft_vocab_size is not None and (
                not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size <= 0):
            raise ValueError("draft_vocab_size must be a positive integer, got "
                             f"{self.draft_vocab_size!r}")

    @classmethod
    def _parse_draft_vocab_size(cls, hf: dict) -> int | None:
        if hf.get("draft_vocab_size") is not None:  # frequency-ranked draft vocabulary
            return _int_field(hf, "draft_vocab_size")
        return None

    @classmethod
    def resolve_aux_layer_ids(cls, aux_layer_ids: tuple[int, ...],
                              num_target_layers: int) -> tuple[int, ...]:
        """Empty: an eagle1 head reads the target's final hidden state."""
        return ()

    @property
    def fc_input_size(self) -> int:
        """``2H``: ``fc`` reads ``[embedding ; feature]``."""
        return 2 * self.hidden_size

    def fit_checkpoint(self, tensor_names: Iterable[str]) -> "EagleConfig":
        """This config with ``has_fc_bias`` as the checkpoint has it (``fc.bias`` or not)."""
        names = set(tensor_names)
        return replace(self, has_fc_bias="fc.bias" in names or "model.fc.bias" in names)

    @classmethod
    def describe_checkpoint(cls, aux_layer_ids: tuple[int, ...]) -> str:
        """The official EAGLE-1 names; the embedding and LM head are the target's."""
        return """official EAGLE-1 checkpoint names (`fc`, `layers.0.*`, no
`input_layernorm`, no final norm); the target's embedding and LM head are shared, not
stored"""


class Eagle3Config(EagleConfig):
    """An EAGLE-3 head: ``fc`` over the target's fused low/mid/high layer inputs, its own
    norm and LM head over a draft vocabulary (``d2t`` maps its ids to the target's)."""

    layout = "eagle3"
    name = "EAGLE-3"
    versions = "EAGLE-3"
    architecture = "LlamaForCausalLMEagle3"
    fuses_target_layers = True
    predicts_target_features = False
    has_own_lm_head = True
    default_fc_bias = False

    def _check_layout_fields(self) -> None:
        if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size <= 0:
            raise ValueError("draft_vocab_size must be a positive integer for an eagle3 head, "
                             f"got {self.draft_vocab_size!r}")
        if self.aux_layer_ids and (len(self.aux_layer_ids) != 3 or min(self.aux_layer_ids) < 0):
            raise ValueError("eagle_aux_hidden_state_layer_ids must be 3 non-negative layer "
                             f"ids (low, mid, high), got {list(self.aux_layer_ids)}")

    @classmethod
    def _parse_draft_vocab_size(cls, hf: dict) -> int | None:
        key = "draft_vocab_size" if hf.get("draft_vocab_size") is not None else "vocab_size"
        return _int_field(hf, key)

    @classmethod
    def resolve_aux_layer_ids(cls, aux_layer_ids: tuple[int, ...],
                              num_target_layers: int) -> tuple[int, ...]:
        """``aux_layer_ids``, else :func:`default_aux_layer_ids` of the target."""
        return tuple(aux_layer_ids or default_aux_layer_ids(num_target_layers))

    @property
    def fc_input_size(self) -> int:
        """``3 * H_target``: ``fc`` reads the three fused target features."""
        return 3 * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def hf_layout_fields(cls, target_hf: dict, draft_vocab_size: int | None,
                         aux_layer_ids: tuple[int, ...]) -> dict:
        """The fused features' width, the draft vocabulary (default: the target's whole
        one) and, when named, the fused layers."""
        fields = {"target_hidden_size": target_hf["hidden_size"],
                  "draft_vocab_size": draft_vocab_size or target_hf["vocab_size"]}
        if aux_layer_ids:
            fields["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
        return fields

    @classmethod
    def describe_checkpoint(cls, aux_layer_ids: tuple[int, ...]) -> str:
        """The official EAGLE-3 names, with the fused layers; the embedding is the target's."""
        return f"""official EAGLE-3 checkpoint names (`fc` over the
target's fused layer inputs {list(aux_layer_ids)}, `midlayer.*`, its own `norm` and
`lm_head` over the draft vocabulary, `d2t`/`t2d`; Li et al. 2025, "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test"); the target's
embedding is shared, not stored"""


#: The layouts, by their config class; :data:`EAGLE_LAYOUTS` are their names.
_CONFIG_CLASSES: tuple[type[EagleConfig], ...] = (Eagle1Config, Eagle3Config)
EAGLE_LAYOUTS = tuple(kind.layout for kind in _CONFIG_CLASSES)


def eagle_config_class(layout: str) -> type[EagleConfig]:
    """The config class of a layout name (``eagle_layout`` in config.json, ``--head-layout``).

    Raises:
        ValueError: ``layout`` is not one of :data:`EAGLE_LAYOUTS`.
    """
    for kind in _CONFIG_CLASSES:
        if kind.layout == layout:
            return kind
    raise ValueError(f"eagle_layout must be one of {EAGLE_LAYOUTS}, got {layout!r}")
