"""Attention backends; importing this package registers the built-in ones."""

from pdserve.engine.attention import torch_backend  # noqa: F401  (registers "torch")
from pdserve.engine.attention import triton_backend  # noqa: F401  (registers "triton")
from pdserve.engine.attention.base import (  # noqa: F401
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionInputs,
    get_backend,
)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionInputs", "get_backend"]
