"""Hadamard rotation of K/V along head_dim before FP8 quantization (undone on receipt).

An orthonormal Hadamard matrix ``H`` (``H = H^T = H^-1``) spreads each vector's energy
evenly over its ``head_dim`` coordinates, so a few outlier channels no longer set the
per-(block, head) absmax scale that every other channel is quantized against; the rounding
error, rotated back, is spread evenly too. The same idea underlies QuaRot (Ashkboos et al.
2024, "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs") and SpinQuant for weights,
activations and KV caches. Measured on the KV wire (``bench/kv_accuracy.py``): mean
KL(exact || codec) per token 2.3x lower than plain FP8 for a float32 SmolLM2, 1.3x for
bfloat16, at the same wire bytes.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


@lru_cache(maxsize=8)
def hadamard(n: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix ``[n, n]`` fp32 (symmetric, its own inverse).

    Raises:
        ValueError: ``n`` is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"n: Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotate(kv: torch.Tensor) -> torch.Tensor:
    """``kv @ H`` along the last dim (head_dim), as a new fp32 tensor of ``kv``'s shape.

    Applying it twice gives ``kv`` back (up to fp32 rounding): the same call undoes it.

    Raises:
        ValueError: the last dim is not a power of two.
    """
    h = hadamard(kv.shape[-1])
    flat = kv.reshape(-1, kv.shape[-1]).float()
    return torch.mm(flat, h).view(kv.shape)
