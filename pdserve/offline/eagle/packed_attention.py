"""Causal attention over packed whole sequences, without a KV cache: for training draft heads.

Training an EAGLE head runs its single decoder layer over many complete sequences at once,
with autograd; the paged cache (written in place, read back by slot) is not needed there.
This backend satisfies :class:`~pdserve.engine.attention.base.AttentionBackend` so the
same module runs either way, but it ignores the cache tensors. It is not registered for
serving. Packed layout::

    tokens:      [ seq 0 (len 5) | seq 1 (len 3) | seq 2 (len 4) ]
    cu_seqlens:  [0,              5,              8,             12]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackedCausalMetadata:
    """Sequence boundaries of a packed batch.

    Attributes:
        cu_seqlens: cumulative sequence lengths, ``[num_seqs + 1]``, starting at 0.
    """

    cu_seqlens: tuple[int, ...]


class PackedCausalAttention:
    """Plain causal SDPA per packed sequence; the cache arguments are ignored."""

    name = "packed_causal"

    def build_metadata(self, seq_lens: list[int]) -> PackedCausalMetadata:
        """Metadata for sequences of ``seq_lens`` tokens laid end to end."""
        cu = [0]
        for n in seq_lens:
            cu.append(cu[-1] + n)
        return PackedCausalMetadata(tuple(cu))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                metadata: PackedCausalMetadata, scale: float,
                kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``q [T, H, D]``, ``k, v [T, Hkv, D]`` -> ``[T, H, D]``, causal within each sequence.

        No cache is read or written (training), so ``k_cache``/``v_cache``/``kv_scales``
        are ignored.
        """
        outs = []
        cu = metadata.cu_seqlens
        for start, end in zip(cu[:-1], cu[1:]):
            out = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True)
            outs.append(out.transpose(0, 1))
        return torch.cat(outs, dim=0)
