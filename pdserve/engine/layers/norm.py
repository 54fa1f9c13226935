"""RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 like transformers.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``x`` (after adding ``residual`` when given).

        Args:
            x: ``[..., hidden_size]`` in the compute dtype.
            residual: same shape and dtype, or None.

        Returns:
            The normalized tensor, or ``(normalized, x + residual)`` when ``residual`` is given
            (the sum is the next residual stream).
        """
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(orig_dtype)
        return out if residual is None else (out, residual)
