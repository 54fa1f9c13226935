"""The model runtime shared by prefill and decode workers."""

from pdserve.engine.config import EngineConfig
from pdserve.engine.entrypoints.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, TokenLogprob
from pdserve.engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
    "RequestDelta", "TokenLogprob",
]
