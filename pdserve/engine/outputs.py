"""What the engine hands back: per-step deltas (workers) and whole results (offline LLM).

The delta types are msgspec structs because they cross process boundaries as msgpack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """Logprob of one generated token under the model's raw distribution.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (natural log) from log_softmax of the raw logits.
        rank: 1-based rank of the token in that distribution.
        top_token_ids: the ``k`` most likely token ids, most likely first.
        top_logprobs: their log-probabilities.
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class RequestDelta(msgspec.Struct, frozen=True):
    """New tokens of one request from one engine step.

    Attributes:
        request_id: the request.
        new_token_ids: tokens appended this step (empty for an abort).
        new_logprobs: one entry per new token when the request asked for logprobs.
        finish_reason: ``stop``, ``length`` or ``abort`` when the request ended this step.
        num_prompt_tokens: prompt length.
        num_cached_tokens: prompt tokens served from the prefix cache.
        queue_time_s: on a request's first delta, seconds it waited before being scheduled.
        prompt_logprobs: on a request's first delta, when it asked for them: one entry per
            prompt token after the first (its logprob given the tokens before it).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        """Whether the request ended this step."""
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One generated sequence of an offline request (``n`` of them per request)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """An offline request's result from :meth:`pdserve.engine.entrypoints.llm.LLM.generate`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    #: with ``SamplingParams.prompt_logprobs``: prompt tokens ``1 ..`` scored by the model
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        """Whether every sequence of the request has a finish reason."""
        return all(o.finish_reason is not None for o in self.outputs)
