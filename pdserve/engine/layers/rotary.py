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
        # rotate_half(x) * sin == roll(x, D/2) * signed_sin with signed_sin = [-sin1, sin2]
        half = head_dim // 2
        signed = emb.sin()
        signed[:, :half] = -signed[:, :half]
        self.register_buffer("signed_sin_cached", signed, persistent=False)
        self.half = half
        #: ``(positions, dtype, cos, signed_sin)`` of the last call: every layer of a forward
        #: passes the same ``positions`` tensor, so the tables are gathered once. Models call
        #: :meth:`forget` as each forward starts (a tensor may be refilled in place).
        self._last: tuple | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` rows of ``positions``, each ``[num_tokens, 1, head_dim]``
        in ``dtype`` (``signed_sin`` has its first half negated; see :meth:`rotate`)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos = self.cos_cached[positions].to(dtype).unsqueeze(1)
        sin = self.signed_sin_cached[positions].to(dtype).unsqueeze(1)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def forget(self) -> None:
        """Drop the tables kept from the last call. A model calls this as its forward starts:
        its ``positions`` may be the same tensor refilled in place (CUDA graphs' static
        inputs, a drafter's step), and a CUDA graph must capture the gather itself."""
        self._last = None

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [num_tokens, num_heads, head_dim]`` (queries, keys, or both side by
        side): ``x * cos + rotate_half(x) * sin``, with ``rotate_half`` as a roll by half
        the head and its sign folded into the table (the same products, so the same
        rounding as the textbook form)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return x * cos + torch.roll(x, self.half, dims=-1) * sin

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
        return self.rotate(positions, q), self.rotate(positions, k)


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
