"""Convert a GGUF file into a float32 Hugging Face checkpoint folder.

Reading a quantized GGUF costs seconds of metadata parsing and dequantization on
every start; the converted folder loads by memory-mapping one safetensors file.
The folder layout::

    out_dir/config.json              hf_config of the GGUF (same dict load_checkpoint returns)
    out_dir/generation_config.json   bos/eos/pad token ids
    out_dir/model.safetensors        every tensor, dequantized, float32, Hugging Face layout
    out_dir/tokenizer.json, ...      tokenizer.save_pretrained (chat template included)
    out_dir/pdserve_source.json      marker: source GGUF path, size, mtime and SHA-256

The marker is written last and the folder is moved into place in one rename,
so a folder with a marker is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from pdserve.engine.loader.checkpoint import load_checkpoint, load_tokenizer
from pdserve.engine.loader.gguf_loader import GGUF_TOKEN_ID_KEYS
from pdserve.engine.loader.safetensors_loader import make_folder_shareable, save_safetensors

SOURCE_MARKER_NAME = "pdserve_source.json"
MARKER_VERSION = 1
# Files a converted folder must contain besides the marker.
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (about 0.3 s for the 98 MB default GGUF)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _source_fingerprint(gguf_path: Path) -> dict[str, Any]:
    """Identity of a source file: resolved path, size, modification time and SHA-256."""
    stat = gguf_path.stat()
    return {
        "marker_version": MARKER_VERSION,
        "source_path": str(gguf_path.resolve()),
        "source_size_bytes": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
        "source_sha256": file_sha256(gguf_path),
    }


def read_source_marker(folder: Path) -> dict[str, Any] | None:
    """Return the folder's source marker, or None if it is absent or unreadable."""
    try:
        with (folder / SOURCE_MARKER_NAME).open(encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_converted_folder_fresh(folder: Path, gguf_path: Path | None) -> bool:
    """True if ``folder`` is a complete conversion of ``gguf_path`` as it is now.

    Same resolved path, size and modification time as the marker records: fresh, without
    reading the file. Otherwise the same size and the same SHA-256 as recorded: fresh too,
    so reinstalling the same package (new mtime) or moving the environment (new path) does
    not send every start back to the slow GGUF load, nor change the cache keys built from
    the resolved model path (``pdserve train-eagle``'s answers and features). A marker
    written before the digest was recorded matches on path, size and mtime only.

    With ``gguf_path=None`` (the source is no longer installed) any complete
    conversion counts as fresh: it is self-contained and nothing newer exists.
    """
    marker = read_source_marker(folder)
    if marker is None or marker.get("marker_version") != MARKER_VERSION:
        return False
    if not all((folder / name).is_file() for name in CONVERTED_FILES):
        return False
    if gguf_path is None:
        return True
    try:
        stat = gguf_path.stat()
    except OSError:  # removed since it was found: nothing to compare with
        return False
    if marker.get("source_size_bytes") != stat.st_size:
        return False
    if (marker.get("source_path"), marker.get("source_mtime_ns")) == (
            str(gguf_path.resolve()), stat.st_mtime_ns):
        return True
    digest = marker.get("source_sha256")
    return isinstance(digest, str) and digest == file_sha256(gguf_path)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented, key-sorted JSON with a trailing newline."""
    with path.open("w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_hf_configs(folder: Path, hf_config: dict[str, Any]) -> None:
    """Write ``config.json`` and ``generation_config.json`` for ``hf_config``.

    A writer, not a reader of model facts: ``hf_config`` is the dict
    :func:`~pdserve.engine.loader.gguf_loader.gguf_to_hf_config` built from the GGUF
    metadata, and it is serialized as it is, so the folder reloads to the same dict.
    ``generation_config.json`` gets the special token ids that dict carries (the
    :data:`~pdserve.engine.loader.gguf_loader.GGUF_TOKEN_ID_KEYS` entries present),
    copied in their stored form (``eos_token_id`` may be an int or a list).
    """
    _write_json(folder / "config.json", hf_config)
    token_id_keys = set(GGUF_TOKEN_ID_KEYS.values())
    token_ids = {key: value for key, value in hf_config.items() if key in token_id_keys}
    _write_json(folder / "generation_config.json", token_ids)


def convert_gguf_to_hf_folder(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Dequantize ``gguf_path`` into a Hugging Face folder at ``out_dir``; return ``out_dir``.

    Any existing ``out_dir`` is replaced. Weights are stored as float32, which
    holds every dequantized GGUF value exactly. Peak memory is about the float32
    model size (540 MB for SmolLM2-135M).

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: the GGUF cannot be loaded (see ``load_checkpoint``).
    """
    # Taken before reading, so a source that changes during conversion reads as stale later.
    fingerprint = _source_fingerprint(gguf_path)
    checkpoint = load_checkpoint(gguf_path)
    tokenizer = load_tokenizer(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tensors = dict(checkpoint.iter_weights(torch.float32, progress=progress))
        save_safetensors(tensors, tmp_dir / "model.safetensors", metadata={"format": "pt"})
        del tensors
        _write_hf_configs(tmp_dir, checkpoint.hf_config)
        tokenizer.save_pretrained(str(tmp_dir))
        _write_json(tmp_dir / SOURCE_MARKER_NAME, fingerprint)
        make_folder_shareable(tmp_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir
