"""Weight and tokenizer loading: Hugging Face safetensors folders, GGUF files, the default model."""

from pdserve.engine.loader.checkpoint import Checkpoint, load_checkpoint, load_tokenizer
from pdserve.engine.loader.default_model import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_REQUIREMENT,
    ModelNotFoundError,
    default_cache_dir,
    find_default_gguf,
    pull_default_model,
    resolve_model,
)
from pdserve.engine.loader.gguf_convert import convert_gguf_to_hf_folder

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_REQUIREMENT",
    "Checkpoint",
    "ModelNotFoundError",
    "convert_gguf_to_hf_folder",
    "default_cache_dir",
    "find_default_gguf",
    "load_checkpoint",
    "load_tokenizer",
    "pull_default_model",
    "resolve_model",
]
