"""Per-request sampling parameters: the one engine type every API schema converts to."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.engine.structured_output.params import StructuredOutputParams

#: Temperatures at or below this are treated as greedy (argmax) decoding.
GREEDY_TEMPERATURE = 1e-5

#: Largest number of top logprobs a request may ask for.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick the next token of one request, and when to stop.

    Semantics follow vLLM's ``SamplingParams`` (and so the OpenAI API):

    - ``temperature`` 0 means greedy decoding; otherwise logits are divided by it.
    - ``top_k`` <= 0 disables top-k; ``top_p`` 1.0 disables nucleus sampling;
      ``min_p`` 0.0 disables min-p (keep tokens with p >= min_p * p_max).
    - ``presence_penalty`` / ``frequency_penalty`` (OpenAI) apply to generated tokens only;
      ``repetition_penalty`` (CTRL, Keskar et al. 2019, as in transformers) applies to
      prompt and generated tokens: positive logits are divided by it, negative multiplied.
    - ``logit_bias`` maps token id to an additive bias on the logits.
    - ``seed`` makes sampling reproducible for this request whatever the batch.
    - ``logprobs``: ``None`` returns none; ``k >= 0`` returns the sampled token's logprob
      and the ``k`` most likely tokens' logprobs.
    - ``prompt_logprobs``: ``None`` returns none; ``k >= 0`` returns, for every prompt token
      after the first, its logprob given the tokens before it and the ``k`` most likely
      tokens there (OpenAI's ``echo`` with ``logprobs``). Such a request skips the prefix
      cache, since cached positions are never run through the model.
    - ``max_tokens`` caps generated tokens (``None``: up to the context length);
      ``min_tokens`` suppresses EOS and ``stop_token_ids`` until that many are generated;
      ``ignore_eos`` keeps generating past EOS.
    - ``structured_output``: a grammar every generated token must keep the output inside
      (JSON schema, regex, choice, EBNF, structural tag); ``None`` for free text.

    Raises:
        ValueError: naming the offending field, for any out-of-range value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutputParams | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids >= 0")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature ~0 or top_k == 1)."""
        return self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when any presence/frequency/repetition penalty changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
