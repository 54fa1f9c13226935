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

Each layout is a pair of classes: its config (:class:`Eagle1Config`, :class:`Eagle3Config`
in :mod:`.eagle_config`, parsed from ``config.json``) and its head
(:class:`Eagle1DraftModel`, :class:`Eagle3DraftModel`, behind the
:class:`EagleDraftModel` interface); :func:`build_eagle_head` builds the head a config
names, and callers ask the objects what differs instead of comparing layout names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.spec_decode.eagle1_head import Eagle1DecoderLayer, Eagle1DraftModel
from pdserve.engine.spec_decode.eagle3_head import Eagle3DecoderLayer, Eagle3DraftModel
from pdserve.engine.spec_decode.eagle_config import (
    EAGLE_LAYOUTS,
    Eagle1Config,
    Eagle3Config,
    EagleConfig,
    default_aux_layer_ids,
    eagle_config_class,
)
from pdserve.engine.spec_decode.eagle_head import EagleDecoderLayer, EagleDraftModel

__all__ = [
    "EAGLE_LAYOUTS", "WEIGHT_FILES", "Eagle1Config", "Eagle1DecoderLayer", "Eagle1DraftModel",
    "Eagle3Config", "Eagle3DecoderLayer", "Eagle3DraftModel", "EagleConfig",
    "EagleDecoderLayer", "EagleDraftModel", "build_eagle_head", "bundled_head_dir",
    "default_aux_layer_ids", "eagle_config_class", "iter_checkpoint", "load_eagle_model",
]

#: Names of the weights file of a head folder, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

#: The head class of each layout.
_HEAD_CLASSES: tuple[type[EagleDraftModel], ...] = (Eagle1DraftModel, Eagle3DraftModel)


def _head_class(kind: type[EagleConfig]) -> type[EagleDraftModel]:
    """The head class of a layout's config class (:func:`eagle_config_class`)."""
    return next(cls for cls in _HEAD_CLASSES if cls.config_class is kind)


def build_eagle_head(cfg: EagleConfig, target: LlamaForCausalLM, backend: AttentionBackend,
                     max_position: int) -> EagleDraftModel:
    """A new head of ``cfg``'s layout for ``target`` (random weights; see
    :class:`EagleDraftModel` for the arguments).

    Raises:
        ValueError: the head does not fit the target (hidden sizes, layer ids, vocab).
    """
    return _head_class(type(cfg))(cfg, target, backend, max_position)


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
    cfg = cfg.fit_checkpoint(name for name, _ in weights)
    device = next(target.parameters()).device
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = build_eagle_head(cfg, target, backend, max_position)
    finally:
        torch.set_default_dtype(old_dtype)
    model.load_weights(weights)
    return model.eval()
