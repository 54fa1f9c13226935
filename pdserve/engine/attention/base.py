"""Attention backend protocol, the per-step inputs every backend understands, and a registry.

NOTE: the invariant every backend relies on: in the flattened token batch, requests that
decode (exactly one query token) come first, then requests that prefill (one or more query
tokens, possibly after cached or previously computed context). The scheduler orders them so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch


@dataclass
class AttentionInputs:
    """Backend-independent description of one step's attention work.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64; cache slot (``block_id * block_size + offset``)
            that each new token's K/V is written to.
        query_lens: per request, tokens computed this step (1 for a decode).
        seq_lens: per request, context length after this step (cached + new tokens).
        block_tables: per request, the block ids holding its context, in order.
        num_decodes: how many leading requests are decodes (query_len == 1).
        block_size: tokens per KV block.
    """

    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    block_size: int


class AttentionBackend(Protocol):
    """What a model layer calls; one instance per engine, shared by all layers."""

    name: str

    def build_metadata(self, inputs: AttentionInputs) -> Any:
        """Turn step inputs into the backend's own metadata, once per step (not per layer)."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Store the new K/V into the paged cache, then attend.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``.
            k, v: ``[num_tokens, num_kv_heads, head_dim]``.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (in place),
                in the compute dtype or ``float8_e4m3fn``.
            metadata: what :meth:`build_metadata` returned for this step.
            scale: softmax scale, usually ``head_dim ** -0.5``.
            kv_scales: FP8 caches only: ``(k_scales, v_scales)``, each
                ``[num_blocks, num_kv_heads]`` fp32 (in place), quantized as
                :mod:`pdserve.engine.kernels.kv_store` describes.

        Returns:
            ``[num_tokens, num_heads, head_dim]`` attention output in the dtype of ``q``.
        """
        ...


#: name -> factory ``(device: torch.device) -> AttentionBackend``.
ATTENTION_BACKENDS: dict[str, Callable[[torch.device], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[torch.device], AttentionBackend]) -> None:
    """Add a backend to the registry (called at import of the backend's module)."""
    ATTENTION_BACKENDS[name] = factory


def default_backend_name(device: torch.device) -> str:
    """The backend chosen for ``attention_backend="auto"`` on this device."""
    if device.type == "cuda" and "triton" in ATTENTION_BACKENDS:
        return "triton"
    return "torch"


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """Instantiate a backend by name ("auto" picks by device).

    Raises:
        ValueError: for an unknown name.
    """
    if name == "auto":
        name = default_backend_name(device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend {name!r} is not available (have: {sorted(ATTENTION_BACKENDS)})"
        )
    return ATTENTION_BACKENDS[name](device)
