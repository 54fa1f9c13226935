"""Model registry keyed by the ``architectures`` field of ``config.json``."""

from __future__ import annotations

from torch import nn

from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.qwen2 import Qwen2ForCausalLM
from pdserve.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """Look up a model class.

    Raises:
        ValueError: for an architecture the engine does not implement.
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported (supported: {sorted(MODEL_REGISTRY)})"
        ) from None
