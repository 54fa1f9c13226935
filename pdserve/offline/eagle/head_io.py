"""EAGLE heads as ``train-eagle`` makes and writes them: a new head for a target
(:func:`new_head`), one continued from a saved head (:func:`load_init_weights`), and the
saved folder (:func:`save_head`: ``config.json`` and ``model.safetensors`` under the
official EAGLE names of the head's layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdserve.engine.spec_decode.eagle import (
    Eagle1Config,
    EagleConfig,
    EagleDraftModel,
    build_eagle_head,
    eagle_config_class,
    iter_checkpoint,
)

#: Rotary settings copied from the target's config.json into the head's.
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
#: Our fused parameter fragment -> official (unfused) names, in shard order.
_UNFUSED = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
            ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


def head_config_dict(target_hf: dict, provenance: dict, draft_vocab_size: int | None = None,
                     intermediate_size: int | None = None,
                     kind: type[EagleConfig] = Eagle1Config,
                     aux_layer_ids: tuple[int, ...] = ()) -> dict:
    """``config.json`` of an EAGLE head of layout ``kind`` for a target (``eagle_layout``
    plus the Llama fields; ``draft_vocab_size`` when it drafts over a frequency-ranked
    vocabulary, always for eagle3; the MLP is ``intermediate_size`` wide, default the
    target's; eagle3 also names its fused layers)."""
    num_heads = int(target_hf["num_attention_heads"])
    hf = {
        "architectures": [kind.architecture],
        "model_type": "llama",
        "eagle_layout": kind.layout,
        "hidden_size": target_hf["hidden_size"],
        "intermediate_size": intermediate_size or target_hf["intermediate_size"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": target_hf.get("num_key_value_heads") or num_heads,
        "head_dim": target_hf.get("head_dim") or target_hf["hidden_size"] // num_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": target_hf.get("rms_norm_eps", 1e-6),
        "vocab_size": target_hf["vocab_size"],
        "attention_bias": False,
        "mlp_bias": False,
        "fc_bias": kind.default_fc_bias,
        "torch_dtype": "bfloat16",
    }
    if draft_vocab_size is not None:
        hf["draft_vocab_size"] = draft_vocab_size
    hf.update(kind.hf_layout_fields(target_hf, draft_vocab_size, aux_layer_ids))
    hf.update({k: target_hf[k] for k in _ROPE_KEYS if k in target_hf})
    hf["pdserve_provenance"] = provenance
    return hf


def head_state_dict(head: EagleDraftModel, dtype: torch.dtype = torch.bfloat16,
                    ) -> dict[str, torch.Tensor]:
    """The head's tensors under official EAGLE names (fused projections split); floating
    tensors in ``dtype`` (the ``d2t``/``t2d`` maps keep int64/bool)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        tensor = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else None)
        for fused, parts in _UNFUSED.items():
            if fused in name:
                sizes = [head.fused_shard(fused, i)[1] for i in range(len(parts))]
                for part, piece in zip(parts, tensor.split(sizes, dim=0)):
                    out[name.replace(fused, part)] = piece.contiguous()
                break
        else:
            out[name] = tensor.contiguous()
    return out


def save_head(head: EagleDraftModel, out: Path, provenance: dict) -> None:
    """Write ``config.json`` and ``model.safetensors`` (bf16) of an EAGLE head into ``out``.

    The folder loads with :func:`pdserve.engine.spec_decode.eagle.load_eagle_model`.
    """
    from pdserve.engine.loader.safetensors_loader import save_safetensors

    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(head_state_dict(head), out / "model.safetensors", metadata={"format": "pt"})
    config = head_config_dict(head.target.cfg.hf_config, provenance, head.cfg.draft_vocab_size,
                              head.cfg.intermediate_size, type(head.cfg), head.aux_layer_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def new_head(target, device: str, max_position: int, backend,
             draft_token_ids: torch.Tensor | None = None,
             intermediate_size: int | None = None, layout: str = Eagle1Config.layout,
             aux_layer_ids: tuple[int, ...] = ()) -> EagleDraftModel:
    """A new fp32 EAGLE head for ``target`` (random decoder layer).

    An eagle3 head starts from the target where shapes allow: its ``norm`` is the target's
    final norm, its LM head the target's rows of the draft ids, and ``fc`` passes the
    high layer's input through (``[0 | 0 | I]``), so the first feature is on the target's
    scale.

    Args:
        draft_token_ids: ``[V_draft]`` int64 distinct target ids (most frequent first) for a
            frequency-ranked draft vocabulary, or None for the whole vocabulary.
        intermediate_size: width of the head's MLP (None: the target's).
        layout: a layout name (:func:`~pdserve.engine.spec_decode.eagle_config.eagle_config_class`).
        aux_layer_ids: eagle3: fused target layers (empty: the default low/mid/high).

    Raises:
        ValueError: as :class:`EagleDraftModel` (aux layer ids outside the target).
    """
    kind = eagle_config_class(layout)
    if kind.has_own_lm_head and draft_token_ids is None:
        draft_token_ids = torch.arange(target.cfg.vocab_size)
    size = None if draft_token_ids is None else len(draft_token_ids)
    cfg = EagleConfig.from_dict(head_config_dict(target.cfg.hf_config, {}, size,
                                                 intermediate_size, kind, aux_layer_ids))
    with torch.device(device):
        head = build_eagle_head(cfg, target, backend, max_position)
    head.start_from_target(draft_token_ids)
    if draft_token_ids is not None:
        ids = draft_token_ids.to(head.d2t.device)
        head.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head


#: Checkpoint name endings of the head's MLP projections, and the axis that is the MLP's width.
_MLP_WIDTH_AXIS = {".mlp.gate_proj.weight": 0, ".mlp.up_proj.weight": 0,
                   ".mlp.down_proj.weight": 1}


@torch.no_grad()
def load_init_weights(head: EagleDraftModel, folder: Path) -> None:
    """Load the EAGLE head in ``folder`` into ``head`` (``train-eagle --init-from``).

    A head whose MLP is narrower than ``head``'s is widened function-preservingly
    (Net2Net-style, Chen et al. 2016, "Net2Net: Accelerating Learning via Knowledge
    Transfer"): the old units keep their weights, the new ``gate``/``up`` rows keep
    ``head``'s random init and the new ``down`` columns are zero, so the widened head
    drafts exactly as the old one until training moves the new units.

    Raises:
        ValueError: the folder's head is wider than ``head``, or does not fit it otherwise.
    """
    width = head.cfg.intermediate_size
    current = head_state_dict(head, torch.float32)

    def widened():
        for name, tensor in iter_checkpoint(folder):
            axis = next((a for end, a in _MLP_WIDTH_AXIS.items() if name.endswith(end)), None)
            if axis is not None and tensor.shape[axis] != width:
                old = tensor.shape[axis]
                if old > width:
                    raise ValueError(f"init_from head's MLP is {old} wide, wider than the "
                                     f"head being trained ({width}); it cannot be narrowed")
                fresh = current[head.own_tensor_name(name)].narrow(axis, old, width - old)
                tensor = torch.cat([tensor.float(), fresh if axis == 0 else
                                    torch.zeros_like(fresh)], dim=axis)
            yield name, tensor

    # eagle1 drafts through the target's LM head rows of this run's ids; an eagle3 head's
    # own LM head rows belong to its d2t, which comes with them
    head.load_weights(widened(), require_vocab_map=head.cfg.has_own_lm_head)
