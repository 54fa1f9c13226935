"""Read (and write) a Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``).

Both layouts ``save_pretrained`` produces are supported::

    folder/config.json                         folder/config.json
    folder/model.safetensors                   folder/model.safetensors.index.json
                                               folder/model-00001-of-00002.safetensors
                                               folder/model-00002-of-00002.safetensors

Only the headers are read when the checkpoint is opened; tensor data is read
from the memory-mapped shards one tensor at a time during iteration.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, then the mode a plain ``open(path, "w")`` gives.

    safetensors creates its files 0600, which hides a shared model cache or a trained head
    from every other user (a server running as another account, a container); this sets
    0666 less the process umask, like the JSON and tokenizer files written beside it.

    Raises:
        OSError: the file cannot be written.
    """
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def make_folder_shareable(folder: Path) -> None:
    """Give a folder made by ``tempfile.mkdtemp`` (0700) the mode ``mkdir`` gives (0777 less
    the umask), before it is renamed into place."""
    os.chmod(folder, 0o777 & ~_umask())


def read_hf_config(folder: Path) -> dict[str, Any]:
    """Return ``folder/config.json`` with a few commonly needed keys filled in.

    Keys are only added, never overwritten: ``head_dim`` (``hidden_size //
    num_attention_heads``) and ``rope_theta`` (from ``rope_parameters``, the
    transformers 5 spelling) when missing. This completes the raw dict before it is
    parsed (:meth:`pdserve.engine.config.ModelArchConfig.from_hf_config`), which is
    where the rest of the engine reads these facts from.

    Raises:
        ValueError: ``config.json`` is missing or is not a JSON object.
    """
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"checkpoint folder {folder} has no config.json")
    with config_path.open(encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} does not contain a JSON object")
    if "head_dim" not in config or config["head_dim"] is None:
        if "hidden_size" in config and "num_attention_heads" in config:
            config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    rope_parameters = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope_parameters, dict):
        if "rope_theta" in rope_parameters:
            config["rope_theta"] = rope_parameters["rope_theta"]
    return config


def _shard_files(folder: Path) -> tuple[list[Path], int]:
    """Return ``(shard_paths, num_tensors)`` for the folder's safetensors weights.

    Raises:
        ValueError: no ``*.safetensors`` file, or the index names a shard that is missing.
    """
    index_path = folder / SAFETENSORS_INDEX_NAME
    if index_path.is_file():
        with index_path.open(encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise ValueError(f"{index_path} names shard {shard.name}, which is missing")
        return shards, len(weight_map)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(
            f"checkpoint folder {folder} has no *.safetensors weights "
            "(other weight formats such as pytorch_model.bin are not supported)"
        )
    num_tensors = 0
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            num_tensors += len(f.keys())
    return shards, num_tensors


class SafetensorsWeightSource:
    """Iterator over the tensors of one or more memory-mapped safetensors shards."""

    def __init__(self, folder: Path) -> None:
        """Raises ValueError if the folder has no (complete) safetensors weights."""
        self._shards, self._num_tensors = _shard_files(folder)

    @property
    def num_tensors(self) -> int:
        """Tensors across all shards (the index's entries when there is one)."""
        return self._num_tensors

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` shard by shard, in stored dtype and shape."""
        for shard in self._shards:
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


def open_safetensors_folder(folder: Path) -> tuple[dict[str, Any], SafetensorsWeightSource]:
    """Return ``(hf_config, weight_source)`` for a Hugging Face checkpoint folder.

    Raises:
        ValueError: ``config.json`` or the safetensors weights are missing.
    """
    return read_hf_config(folder), SafetensorsWeightSource(folder)
