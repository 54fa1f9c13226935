"""Rotary position embedding (Su et al. 2021, RoFormer) with the scaling types of HF configs.

Uses the "rotate half" layout of Hugging Face checkpoints: the first and second halves of
each head form the (real, imaginary) pairs. Supported ``rope_type`` values: ``default``,
``linear`` (position interpolation, Chen et al. 2023) and ``llama3`` (Llama 3.1's
frequency-dependent scaling).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn


def _default_inv_freq(head_dim: int, base: float, params: dict) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)


def _linear_inv_freq(head_dim: int, base: float, params: dict) -> torch.Tensor:
    return _default_inv_freq(head_dim, base, params) / float(params["factor"])


def _llama3_inv_freq(head_dim: int, base: float, params: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(head_dim, base, params)
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


#: rope_type -> inverse-frequency builder ``(head_dim, base, params) -> [head_dim // 2] fp32``.
ROPE_INV_FREQ: dict[str, Callable[[int, float, dict], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute token position.

    Args:
        head_dim: rotary dimension (the full head dimension here).
        max_position: table length; positions must be below it.
        base: ``rope_theta``.
        rope_type: a key of :data:`ROPE_INV_FREQ`.
        params: the config's rope scaling parameters (``factor`` etc.).

    Raises:
        ValueError: for an unknown ``rope_type``.
    """

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_type: str = "default",
        params: dict | None = None,
    ) -> None:
        super().__init__()
        if rope_type not in ROPE_INV_FREQ:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported (supported: {sorted(ROPE_INV_FREQ)})"
            )
        inv_freq = ROPE_INV_FREQ[rope_type](head_dim, base, params or {})
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim // 2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys.

        Args:
            positions: ``[num_tokens]`` int64 absolute positions.
            q: ``[num_tokens, num_heads, head_dim]``.
            k: ``[num_tokens, num_kv_heads, head_dim]``.

        Returns:
            Rotated ``(q, k)`` in their input dtypes.
        """
        cos = self.cos_cached[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin_cached[positions].to(q.dtype).unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k


def rope_from_hf_config(hf_config: dict, head_dim: int, max_position: int) -> RotaryEmbedding:
    """Build the rotary embedding a Hugging Face ``config.json`` asks for.

    Reads ``rope_parameters`` (transformers >= 5) or the older ``rope_theta`` +
    ``rope_scaling`` pair.
    """
    params = dict(hf_config.get("rope_parameters") or {})
    legacy = hf_config.get("rope_scaling") or {}
    params = {**legacy, **params}
    base = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return RotaryEmbedding(head_dim, max_position, base, rope_type, params)
