"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time

import torch

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from pdserve.engine.structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    """Where a request is; a finished status's value is its OpenAI finish reason."""

    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        """True for the three ``FINISHED_*`` statuses."""
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason (``stop``, ``length``, ``abort``), None while live."""
        return self.value if self.is_finished else None


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED}


class Request:
    """One sequence being generated.

    ``token_ids`` is prompt + output so far; ``num_computed_tokens`` of them have K/V in the
    cache. After preemption (by recompute) ``num_computed_tokens`` drops to 0 and the whole
    of ``token_ids`` is prefilled again; the output so far is kept.

    Attributes:
        block_table: block ids holding this request's K/V, in position order.
        block_hashes: chained hashes of its full blocks (prefix caching), computed lazily.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        max_tokens: output limit resolved against the model length.
        generator: per-request RNG when ``sampling_params.seed`` is set.
        export_kv: a prefill worker's request: copy its KV out when it finishes.
        spec_token_ids: draft tokens proposed for the next verification step (speculation).
        spec_draft_probs: ``[len(spec_token_ids), vocab]`` fp32, the draft distribution
            (after temperature) they were sampled from; None for point-mass drafts.
        num_draft_computed: leading tokens whose K/V the draft model (or EAGLE head) holds.
        grammar: the request's grammar matcher (structured outputs), None for free text.
        prompt_logprobs: logprobs of prompt tokens ``1 ..`` collected so far, when
            ``sampling_params.prompt_logprobs`` asks for them (filled chunk by chunk).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int,
                 eos_token_ids: tuple[int, ...], device: torch.device,
                 arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.added_s = time.monotonic()
        self.first_scheduled_s: float | None = None
        self.export_kv = False
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: torch.Tensor | None = None
        self.num_draft_computed = 0
        self.grammar: GrammarMatcher | None = None
        self.prompt_logprobs: list[TokenLogprob] = []
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling_params.seed)

    def skip_sampled_draws(self, num_tokens: int, vocab_size: int) -> None:
        """Advance a seeded, sampled request's generator past ``num_tokens`` tokens that
        were sampled elsewhere (another worker before a migration, the prefill worker's
        first token), so it continues its random stream where that worker stopped: the
        sampler draws one fp64 uniform per token (whatever ``vocab_size``). Speculative
        decoding draws a varying amount per step: its continuations are not reproducible."""
        if self.generator is None or self.sampling_params.temperature <= GREEDY_TEMPERATURE:
            return
        torch.rand(num_tokens, dtype=torch.float64, generator=self.generator,
                   device=self.generator.device)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (outputs given at :meth:`LLMEngine.add_request` count)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt logprobs are asked for and not all collected yet."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the tokens after the prompt."""
        return self.token_ids[self.num_prompt_tokens:]

    def append_output_token(self, token_id: int) -> None:
        """Append a generated token (its K/V is computed by a later step)."""
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Finished status after the last appended token, or None to keep going."""
        params = self.sampling_params
        last = self.token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def resolve_max_tokens(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                       max_model_len: int) -> int:
    """A new request's output limit: ``params.max_tokens``, or all the room its prompt
    leaves in ``max_model_len``.

    Raises:
        ValueError: empty prompt, a token id outside the vocabulary (prompt or
            ``logit_bias``), or prompt (+ max_tokens) longer than ``max_model_len``.
    """
    if not prompt_token_ids:
        raise ValueError("prompt must contain at least one token")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:
        raise ValueError(f"prompt has {num_prompt} tokens; the maximum context length is "
                         f"{max_model_len}, which leaves no room for output")
    room = max_model_len - num_prompt
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
                         f"maximum context length {max_model_len}")
    if params.logit_bias and any(t >= vocab_size for t in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be < vocab size {vocab_size}")
    return max_tokens
