"""From logits to tokens: the batched sampler, its per-step metadata, the logits
transforms (penalties, top-k/top-p, min-p) and logprobs. Speculative verification
(:mod:`pdserve.engine.spec_decode.rejection_sampler`) builds on the same pieces."""

from pdserve.engine.sample.logits_processors import apply_min_p, apply_penalties, apply_top_k_top_p
from pdserve.engine.sample.logprobs import LogprobsTensors, gather_logprobs
from pdserve.engine.sample.sampler import Sampler, SamplerOutput
from pdserve.engine.sample.sampling_metadata import PenaltyTensors, SamplingMetadata

__all__ = [
    "LogprobsTensors", "PenaltyTensors", "Sampler", "SamplerOutput", "SamplingMetadata",
    "apply_min_p", "apply_penalties", "apply_top_k_top_p", "gather_logprobs",
]
