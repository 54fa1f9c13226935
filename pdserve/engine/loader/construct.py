"""Building a model's modules before its weights are loaded into them."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


def _keep_uninitialized(module: nn.Module) -> None:
    """Stands in for ``reset_parameters``: the loader writes every weight."""


@contextmanager
def building_model(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Modules built inside get ``dtype`` parameters on ``device``, and ``nn.Linear`` and
    ``nn.Embedding`` skip their random initialization: their weights are left as
    allocated (``torch.empty``) for a loader that writes each of them and raises for any it
    does not (the models' ``load_weights``, shards of fused layers included, and the
    quantized loader). Kaiming-uniform init of
    SmolLM2's ~135 M weights took ~2.7 s of each worker's start on one core.

    Not thread-safe: the two classes' ``reset_parameters`` are swapped while the block
    runs, so build models on one thread at a time.
    """
    old_dtype = torch.get_default_dtype()
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    torch.set_default_dtype(dtype)
    try:
        for cls in saved:
            cls.reset_parameters = _keep_uninitialized
        with device:
            yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset
        torch.set_default_dtype(old_dtype)
