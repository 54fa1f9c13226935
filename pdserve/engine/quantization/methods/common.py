"""Small helpers the method files share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pdserve.engine.loader.checkpoint import Checkpoint


def iter_stored_tensors(checkpoint: Checkpoint) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors in their stored dtypes (int32 packs stay int32)."""
    yield from checkpoint.source.iter_tensors()


def is_dense(shards: list[dict[str, Any]]) -> bool:
    """Whether every shard holds a plain floating-point ``weight``."""
    return all(isinstance(s.get("weight"), torch.Tensor) and s["weight"].is_floating_point()
               for s in shards)


def dense_weight(shards: list[dict[str, Any]]) -> torch.Tensor:
    """The shards' ``weight`` rows stacked: ``[sum(rows), in]``."""
    return torch.cat([s["weight"] for s in shards])


class DenseQuantizingMethod:
    """Base of methods that quantize a dense checkpoint's weights at load (fp8, rtn-*).

    Subclasses set ``name`` and implement ``build``.
    """

    quantizes_dense = True

    def __init__(self, hf_config: dict[str, Any]) -> None:
        del hf_config  # dense checkpoints carry no quantization settings

    def iter_tensors(self, checkpoint: Checkpoint) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors as stored (:func:`iter_stored_tensors`)."""
        return iter_stored_tensors(checkpoint)

    def is_complete(self, shard: dict[str, Any]) -> bool:
        """A shard needs only its dense ``weight``."""
        return "weight" in shard
