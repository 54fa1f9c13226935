"""One entry point for model weights, whatever the on-disk format.

``load_checkpoint`` opens either a Hugging Face folder (``config.json`` +
safetensors) or a single ``.gguf`` file and returns a ``Checkpoint``: a
``config.json``-style dict plus an iterator of ``(hf_parameter_name, tensor)``
pairs in the Hugging Face layout. Model code therefore only ever sees Hugging
Face names and layouts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tqdm import tqdm

from pdserve.engine.loader.gguf_loader import open_gguf
from pdserve.engine.loader.safetensors_loader import open_safetensors_folder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"


class WeightSource(Protocol):
    """A checkpoint format: how many tensors it has and how to read them."""

    @property
    def num_tensors(self) -> int:
        """How many tensors ``iter_tensors`` yields (sizes the load progress bar)."""
        ...

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_parameter_name, tensor)`` in the source's own dtype."""
        ...


@dataclass
class Checkpoint:
    """An opened checkpoint: its config and a lazy stream of its weights.

    Attributes:
        path: the folder or ``.gguf`` file it was opened from.
        hf_config: ``config.json``-style dict (``architectures``, ``model_type``,
            ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``, ``head_dim``, ``rope_theta``, ...).
        num_tensors: number of tensors ``iter_weights`` yields.
    """

    path: Path
    hf_config: dict[str, Any]
    num_tensors: int
    source: WeightSource = field(repr=False)

    def iter_weights(
        self, dtype: torch.dtype, progress: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every weight as ``(hf_parameter_name, tensor)``, cast to ``dtype``.

        Names are Hugging Face parameter names (``model.embed_tokens.weight``,
        ``model.layers.0.self_attn.q_proj.weight``, ..., ``lm_head.weight`` only if
        stored). Tensors have the Hugging Face shape, e.g. ``[out_features,
        in_features]`` for linear weights, and dtype ``dtype``; GGUF tensors are
        dequantized first. Each tensor is read when it is yielded, so peak memory
        is one tensor plus whatever the caller keeps.

        Args:
            dtype: target floating point dtype, e.g. ``torch.bfloat16``.
            progress: show a tqdm progress bar (one step per tensor) where stderr is a
                terminal; none where it is a file or a pipe (a log of ``serve`` would hold
                its workers' bars interleaved).
        """
        with tqdm(
            total=self.num_tensors,
            desc=f"Loading {self.path.name}",
            unit="tensor",
            disable=None if progress else True,  # None: tqdm's own check for a terminal
        ) as bar:
            for name, tensor in self.source.iter_tensors():
                yield name, tensor.to(dtype)
                bar.update(1)


def _require_existing(path: str | Path) -> Path:
    """Return ``path`` as a ``Path``; raise FileNotFoundError naming it if absent."""
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    return resolved


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Open a Hugging Face checkpoint folder or a ``.gguf`` file.

    Nothing but headers and metadata is read here; weights stream from
    ``Checkpoint.iter_weights``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a folder without ``config.json`` or without ``*.safetensors``;
            a file that is not ``.gguf``; a GGUF file with an unsupported
            architecture, tensor name or tensor type (the message names it).
    """
    resolved = _require_existing(path)
    if resolved.is_dir():
        hf_config, source = open_safetensors_folder(resolved)
    elif resolved.suffix == GGUF_SUFFIX:
        hf_config, source = open_gguf(resolved)
    else:
        raise ValueError(
            f"model path {str(path)!r} is neither a checkpoint folder nor a {GGUF_SUFFIX} file"
        )
    return Checkpoint(
        path=resolved, hf_config=hf_config, num_tensors=source.num_tensors, source=source
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer (with its chat template) stored with a checkpoint.

    A folder is read with ``AutoTokenizer.from_pretrained(folder)``; a ``.gguf``
    file with ``AutoTokenizer.from_pretrained(parent, gguf_file=name)``, which
    rebuilds the tokenizer and ``chat_template`` from the GGUF metadata. A
    tokenizer without a chat template is returned with a logged warning.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a file that is not ``.gguf``.
    """
    from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

    resolved = _require_existing(path)
    if resolved.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(str(resolved))
    elif resolved.suffix == GGUF_SUFFIX:
        tokenizer = AutoTokenizer.from_pretrained(str(resolved.parent), gguf_file=resolved.name)
    else:
        raise ValueError(
            f"model path {str(path)!r} is neither a checkpoint folder nor a {GGUF_SUFFIX} file"
        )
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("tokenizer at %s has no chat template", resolved)
    return tokenizer
