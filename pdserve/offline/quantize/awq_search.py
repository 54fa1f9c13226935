"""Activation-aware weight quantization (AWQ; Lin et al. 2023, "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration"), searched on calibration activations.

For each group of linear layers that read the same input ``x`` (q/k/v after
``input_layernorm``; gate/up after ``post_attention_layernorm``; ``down_proj`` after
``up_proj``), AWQ scales input channel ``i`` of the weights by ``s_i`` and the input by
``1 / s_i``; salient channels (large mean ``|x_i|``) get larger ``s_i`` and so smaller
relative rounding error. ``s = mean|x|^alpha`` (normalized by ``sqrt(max * min)``), with
``alpha`` on a grid in ``[0, 1)`` chosen to minimize the output MSE
``|| x W^T - (x / s) Q(W diag(s))^T ||^2`` on sampled calibration tokens (``alpha = 0`` is
plain round-to-nearest, so the search never does worse than RTN on those tokens). The
``1 / s`` is folded into the previous RMSNorm weight or the ``up_proj`` rows, so inference
costs nothing extra. ``o_proj`` is scaled only when its input width equals ``v_proj``'s
output (no GQA), as in the paper's reference implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import logging
import time

import torch
from torch import nn

from pdserve.engine.quantization.int_weight import quantize_rtn
from pdserve.offline.perplexity import perplexity

logger = logging.getLogger(__name__)


@dataclass
class InputStats:
    """Calibration statistics of one linear layer's input.

    Attributes:
        abs_sum: ``[in]`` fp32, sum of ``|x|`` over every calibration token.
        num_tokens: tokens summed.
        samples: ``[num_rows, in]`` fp32 input rows kept for the MSE search.
    """

    abs_sum: torch.Tensor
    num_tokens: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)

    def mean_abs(self) -> torch.Tensor:
        """``[in]`` fp32: the mean ``|x|`` of each input channel (AWQ's activation
        magnitude; zeros before any token was recorded)."""
        return self.abs_sum / max(1, self.num_tokens)


def collect_input_stats(engine, sequences: list[list[int]], layer_names: list[str],
                        rows_per_sequence: int, seed: int = 0) -> dict[str, InputStats]:
    """Run ``sequences`` through ``engine`` and record the inputs of ``layer_names``.

    Args:
        engine: an idle fp32 :class:`~pdserve.engine.llm_engine.LLMEngine`.
        sequences: calibration token windows.
        layer_names: module names (``model.layers.0.self_attn.qkv_proj``, ...).
        rows_per_sequence: input rows sampled per sequence and layer for the search.
    """
    model = engine.runner.model
    gen = torch.Generator().manual_seed(seed)
    stats: dict[str, InputStats] = {}
    handles = []
    for name in layer_names:
        module = model.get_submodule(name)
        stats[name] = InputStats(torch.zeros(module.in_features))

        def hook(_mod: nn.Module, args: tuple[torch.Tensor], name: str = name) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # [tokens, in]
            st = stats[name]
            st.abs_sum += x.abs().sum(0)
            st.num_tokens += x.shape[0]
            keep = torch.randperm(x.shape[0], generator=gen)[:rows_per_sequence]
            st.samples.append(x[keep].clone())

        handles.append(module.register_forward_pre_hook(hook))
    try:
        for seq in sequences:
            perplexity(engine, seq, chunk_size=len(seq))
    finally:
        for h in handles:
            h.remove()
    return stats


def fake_quantize(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``dequantize(quantize_rtn(weight))``: ``[out, in]`` fp32."""
    return quantize_rtn(weight, bits, group_size).dequantize(torch.float32)


@torch.no_grad()
def search_scales(weight: torch.Tensor, stats: InputStats, bits: int, group_size: int,
                  num_grid: int = 20) -> tuple[torch.Tensor, float, float]:
    """Best AWQ input scales for ``weight``.

    Args:
        weight: ``[out, in]`` fp32 (the group's weights stacked by rows).
        stats: calibration statistics of the group's input.
        num_grid: alphas tried: ``0, 1/num_grid, ..., (num_grid-1)/num_grid``.

    Returns:
        ``(scales [in] fp32, best_mse, rtn_mse)``; ``rtn_mse`` is the error at alpha = 0.
    """
    x = torch.cat(stats.samples)  # [rows, in]
    ref = x @ weight.t()
    x_mean = stats.mean_abs().clamp(min=1e-8)
    best = (torch.ones_like(x_mean), float("inf"))
    rtn_mse = float("nan")
    for i in range(num_grid):
        alpha = i / num_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        w_q = fake_quantize(weight * s, bits, group_size) / s
        mse = float((x @ w_q.t() - ref).pow(2).mean())
        if i == 0:
            rtn_mse = mse
        if mse < best[1]:
            best = (s, mse)
    return best[0], best[1], rtn_mse


@dataclass
class AwqReport:
    """What the search did: per scaled group, the chosen MSE beside RTN's."""

    num_groups: int = 0
    mse_awq: list[float] = field(default_factory=list)
    mse_rtn: list[float] = field(default_factory=list)


@torch.no_grad()
def apply_awq(engine, sequences: list[list[int]], bits: int, group_size: int,
              rows_per_sequence: int = 16, num_grid: int = 20) -> AwqReport:
    """Search AWQ scales for every decoder layer of ``engine``'s fp32 Llama-family model
    and fold them into its weights in place (the model computes the same function).

    Raises:
        ValueError: the engine's model is not fp32 ``nn.Linear`` layers.
    """
    model = engine.runner.model
    layers = model.model.layers
    names = []
    for i, layer in enumerate(layers):
        for sub in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                    "mlp.down_proj"):
            module = layer.get_submodule(sub)
            if not isinstance(module, nn.Linear) or module.weight.dtype != torch.float32:
                raise ValueError("AWQ needs an fp32 model with nn.Linear layers")
            names.append(f"model.layers.{i}.{sub}")
    t0 = time.perf_counter()
    stats = collect_input_stats(engine, sequences, names, rows_per_sequence)
    logger.info("AWQ: calibration activations of %d windows in %.1f s", len(sequences),
                time.perf_counter() - t0)
    report = AwqReport()
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"model.layers.{i}."

        def scale_group(linear: nn.Linear, key: str) -> torch.Tensor:
            s, mse, rtn = search_scales(linear.weight, stats[prefix + key], bits, group_size,
                                        num_grid)
            linear.weight.mul_(s)
            report.num_groups += 1
            report.mse_awq.append(mse)
            report.mse_rtn.append(rtn)
            return s

        s = scale_group(attn.qkv_proj, "self_attn.qkv_proj")
        layer.input_layernorm.weight.div_(s)
        if attn.o_proj.in_features == attn.kv_size:  # no GQA: fold into v_proj's rows
            s = scale_group(attn.o_proj, "self_attn.o_proj")
            attn.qkv_proj.weight[attn.q_size + attn.kv_size:].div_(s[:, None])
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias[attn.q_size + attn.kv_size:].div_(s)
        s = scale_group(mlp.gate_up_proj, "mlp.gate_up_proj")
        layer.post_attention_layernorm.weight.div_(s)
        s = scale_group(mlp.down_proj, "mlp.down_proj")
        half = mlp.gate_up_proj.out_features // 2
        mlp.gate_up_proj.weight[half:].div_(s[:, None])
        logger.info("AWQ: layer %d searched (%.1f s)", i, time.perf_counter() - t0)
    return report
