"""Write an int4/int8 checkpoint the engine loads: Hugging Face names, one safetensors file.

Layouts (see :mod:`.int_layouts`): ``compressed-tensors`` (default; llm-compressor's
``pack-quantized``, 4 or 8 bits), ``awq`` (AutoAWQ GEMM, 4 bits) or ``gptq``
(``checkpoint_format: gptq_v2``, zeros stored as is, so a zero of 0 survives). Fused
layers are split back into ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdserve.engine.loader.safetensors_loader import save_safetensors
from pdserve.engine.quantization.int_layouts import pack_awq, pack_compressed_tensors, pack_gptq
from pdserve.engine.quantization.int_weight import IntWeight
from pdserve.engine.quantization.loading import FUSED_SHARDS

CHECKPOINT_FORMATS = ("compressed-tensors", "awq", "gptq")

_FUSED_PARTS = {fused: [hf for hf, (f, _) in FUSED_SHARDS.items() if f == fused]
                for fused in ("qkv_proj", "gate_up_proj")}


def quantization_config(fmt: str, bits: int, group_size: int, ignore: list[str],
                        method: str) -> dict[str, Any]:
    """The ``quantization_config`` entry of ``config.json`` for ``fmt``.

    Raises:
        ValueError: an unknown format, or AWQ with bits other than 4.
    """
    if fmt == "compressed-tensors":
        return {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": bits, "type": "int", "symmetric": False,
                            "strategy": "group", "group_size": group_size}}},
            "ignore": ignore, "pdserve_method": method,
        }
    if fmt == "awq":
        if bits != 4:
            raise ValueError("the AWQ layout holds 4-bit weights; use --format "
                             "compressed-tensors for 8 bits")
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": ignore, "pdserve_method": method}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                "desc_act": False, "sym": False, "checkpoint_format": "gptq_v2",
                "pdserve_method": method}
    raise ValueError(f"--format must be one of {', '.join(CHECKPOINT_FORMATS)}, got {fmt!r}")


def _pack(fmt: str, weight: IntWeight) -> dict[str, torch.Tensor]:
    if fmt == "compressed-tensors":
        return pack_compressed_tensors(weight)
    if fmt == "awq":
        return pack_awq(weight)
    return pack_gptq(weight, v1_zero_offset=False)


def _hf_parts(name: str, shard_sizes: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """``(hf_module_name, first_row, num_rows)`` for each shard of our layer ``name``."""
    parent, _, leaf = name.rpartition(".")
    hf_leaves = _FUSED_PARTS.get(leaf, [leaf])
    starts = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
    return [(f"{parent}.{hf}" if parent else hf, st, n)
            for hf, st, n in zip(hf_leaves, starts, shard_sizes, strict=True)]


def collect_tensors(model: nn.Module, quantized: dict[str, IntWeight],
                    shard_sizes: dict[str, tuple[int, ...]], fmt: str,
                    tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor by Hugging Face name.

    Args:
        model: the (AWQ-scaled) fp32 model; its dense tensors are written as they are.
        quantized: our layer name -> its quantized weight.
        shard_sizes: our fused layer name -> rows of each shard.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name in quantized:
            weight = quantized[name]
            for hf, start, rows in _hf_parts(name, shard_sizes[name]):
                for suffix, t in _pack(fmt, weight.rows(start, start + rows)).items():
                    tensors[f"{hf}.{suffix}"] = t.contiguous()
            if getattr(module, "bias", None) is not None:
                for hf, start, rows in _hf_parts(name, shard_sizes[name]):
                    tensors[f"{hf}.bias"] = module.bias[start:start + rows].contiguous()
            continue
        if isinstance(module, nn.Linear) and name in shard_sizes:
            if name == "lm_head" and tie_word_embeddings:
                continue
            for hf, start, rows in _hf_parts(name, shard_sizes[name]):
                tensors[f"{hf}.weight"] = module.weight[start:start + rows].contiguous()
                if module.bias is not None:
                    tensors[f"{hf}.bias"] = module.bias[start:start + rows].contiguous()
    skip_prefixes = tuple(f"{n}." for n in shard_sizes)
    for pname, p in model.named_parameters():
        if not pname.startswith(skip_prefixes) and pname not in tensors:
            if pname == "lm_head.weight" and tie_word_embeddings:
                continue
            tensors[pname] = p.detach().contiguous()
    return tensors


def write_checkpoint(out_dir: Path, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                     qconfig: dict[str, Any], tokenizer: Any, report: dict[str, Any]) -> None:
    """Write ``config.json``, ``model.safetensors``, the tokenizer and ``quantize_report.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config["quantization_config"] = qconfig
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_safetensors(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "quantize_report.json").write_text(json.dumps(report, indent=2))
