"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up`` for a fused ``[gate ; up]`` projection.

    Args:
        x: ``[num_tokens, 2 * intermediate_size]``, gate half first.

    Returns:
        ``[num_tokens, intermediate_size]`` in the input dtype.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
