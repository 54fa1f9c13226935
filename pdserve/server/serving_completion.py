"""``POST /v1/completions``: one or several prompts, stream and non-stream."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.server.detokenizer import IncrementalDetokenizer
from pdserve.server.errors import APIError
from pdserve.server.generation import ChoiceEvent, Generation, merge_streams
from pdserve.server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    PromptTokensDetails,
    UsageInfo,
)
from pdserve.server.serving_common import (
    check_model,
    check_prompt_chars,
    check_prompt_length,
    check_structured_output,
    off_loop,
    parse_request,
    sse,
    start_generation,
    wait_for_start,
    to_params,
    collect_choices,
)
from pdserve.server.state import ServerState


def prompt_id_lists(state: ServerState, req: CompletionRequest,
                    max_model_len: int) -> list[list[int]]:
    """Token ids of each prompt (strings are tokenized, each refused as soon as it is
    ``max_model_len`` tokens or more; id lists are range-checked)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    vocab = len(state.tokenizer)
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(list(state.tokenizer.encode(p)))
            check_prompt_length(max_model_len, len(out[-1]), None, "prompt")
        else:
            if any(t < 0 or t >= vocab for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
            out.append(list(p))
    if any(not ids for ids in out):
        raise APIError(400, "prompt must not be empty", "prompt")
    return out


def completion_logprobs(tokenizer, lps: list[TokenLogprob] | None, offset: int = 0
                        ) -> CompletionLogProbs | None:
    """Logprobs of generated tokens in the completions shape (``None`` for ``None``).

    ``offset`` is the character offset of the first token's text in the choice's text
    (the echoed prompt and earlier deltas come before it).
    """
    if lps is None:
        return None
    tokens, token_lps, tops = [], [], []
    for lp in lps:
        tokens.append(tokenizer.decode([lp.token_id]))
        token_lps.append(lp.logprob)
        tops.append({tokenizer.decode([t]): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
    offsets = token_offsets(tokenizer, [lp.token_id for lp in lps], offset, True)
    return CompletionLogProbs(text_offset=offsets, token_logprobs=token_lps, tokens=tokens,
                              top_logprobs=tops)


def token_offsets(tokenizer, token_ids: list[int], start: int,
                  skip_special_tokens: bool) -> list[int]:
    """Where each token's text starts in the text ``token_ids`` decode to, counted from
    ``start``: a token holding only part of a character starts where that character does
    (its own decode, U+FFFD, is not the text's)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
    offsets, position = [], start
    for token_id in token_ids:
        offsets.append(position)
        position += len(detokenizer.add_tokens([token_id]))
    return offsets


def echo_logprobs(tokenizer, prompt_ids: list[int], lps: list[TokenLogprob] | None,
                  num_top: int) -> CompletionLogProbs:
    """Logprobs of an echoed prompt: every prompt token, the first one unscored (``null``).

    ``lps`` holds tokens ``1 ..`` as the engine scored them; ``num_top`` is the request's
    ``logprobs`` (top alternatives per position).
    """
    lps = lps or []
    if len(lps) != len(prompt_ids) - 1:
        raise RuntimeError(f"worker returned {len(lps)} prompt logprobs for "
                           f"{len(prompt_ids)} prompt tokens")
    tokens = [tokenizer.decode([t]) for t in prompt_ids]
    offsets = token_offsets(tokenizer, prompt_ids, 0, False)  # echo: decode(prompt_ids)
    return CompletionLogProbs(
        text_offset=offsets, tokens=tokens,
        token_logprobs=[None] + [lp.logprob for lp in lps],
        top_logprobs=[None] + [{tokenizer.decode([t]): v for t, v in zip(
            lp.top_token_ids[:num_top], lp.top_logprobs[:num_top])} for lp in lps])


def _joined(a: CompletionLogProbs | None, b: CompletionLogProbs | None
            ) -> CompletionLogProbs | None:
    """``a``'s entries followed by ``b``'s; either alone when the other is ``None``."""
    if a is None or b is None:
        return a or b
    return CompletionLogProbs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)


async def _merged(gens: list[Generation], n: int) -> AsyncIterator[ChoiceEvent]:
    """Events of several prompts' generations; choice index = prompt_index * n + j."""

    async def offset(k: int, gen: Generation) -> AsyncIterator[ChoiceEvent]:
        async for ev in gen.events():
            ev.index += k * n
            yield ev

    async for ev in merge_streams([offset(k, g) for k, g in enumerate(gens)]):
        yield ev


def _usage(gens: list[Generation]) -> UsageInfo:
    """Token counts summed over every prompt's generation."""
    p = sum(g.num_prompt_tokens for g in gens)
    c = sum(g.num_completion_tokens for g in gens)
    cached = sum(g.num_cached_tokens for g in gens)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def create_completion(state: ServerState, raw: bytes):
    """``POST /v1/completions``: every prompt's ``n`` choices, streamed or in one body.

    Raises:
        APIError: 400 for an invalid request (``param`` names the field), 404 for a model
            this server does not serve, 503 when no worker can take a prompt.
    """
    req = await off_loop(raw, parse_request, CompletionRequest, raw)
    check_model(state, req.model)
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    check_prompt_chars(state, max((len(t) for t in texts if isinstance(t, str)), default=0),
                       "prompt")
    prompts = await off_loop(raw, prompt_id_lists, state, req, state.max_model_len)
    params_list = await _checked_params(state, req, prompts)
    await wait_for_start(state)
    request_id, gens = _start_generations(state, prompts, params_list, req.stop_list,
                                          req.include_stop_str_in_output)
    completion = _CompletionInFlight(
        state, req, gens, request_id, created=int(time.time()), n=params_list[0].n,
        num_top=params_list[0].logprobs,
        # echo: each choice's text starts with its prompt (given text, or decoded ids)
        echoed=[(p if isinstance(p, str) else state.tokenizer.decode(ids)) if req.echo else ""
                for p, ids in zip(req.prompt_list, prompts)])
    if req.stream:
        return StreamingResponse(sse(completion.chunks()), media_type="text/event-stream")
    resp = await completion.response()
    return JSONResponse(resp.model_dump(mode="json"))


async def _checked_params(state: ServerState, req: CompletionRequest,
                          prompts: list[list[int]]) -> list[SamplingParams]:
    """Each prompt's engine parameters, after the checks that precede any submission: the
    context length per prompt, the output constraint (compiled once, counted per prompt)
    and the total number of choices.

    Raises:
        APIError: 400 naming the field at fault.
    """
    params_list = [to_params(state, req, len(p), "prompt") for p in prompts]
    n = params_list[0].n
    await check_structured_output(params_list[0].structured_output,
                                  req.structured_output_param)
    if params_list[0].structured_output is not None:
        for _ in prompts:
            state.metrics.observe_structured_output(params_list[0].structured_output.kind.value)
    num_choices = n * len(prompts)
    if num_choices > state.router.max_num_inflight:  # a 503 would invite futile retries
        raise APIError(400, f"{len(prompts)} prompts x n={n} ask for {num_choices} choices; "
                            f"this server runs at most {state.router.max_num_inflight} at once",
                       "prompt")
    return params_list


def _start_generations(state: ServerState, prompts: list[list[int]],
                       params_list: list[SamplingParams], stop: list[str], include_stop: bool
                       ) -> tuple[str, list[Generation]]:
    """Submit every prompt; the response id is the first prompt's request id.

    Raises:
        APIError: 503 when a prompt finds no worker; the prompts already placed are
            aborted first.
    """
    gens: list[Generation] = []
    request_id = ""
    try:
        for ids, params in zip(prompts, params_list):
            rid, gen = start_generation(state, "cmpl", ids, params, stop, include_stop)
            request_id = request_id or rid
            gens.append(gen)
    except APIError:
        for g in gens:
            for c in g.choices:
                state.router.abort(c.handle.request_id)
        raise
    return request_id, gens


@dataclass
class _CompletionInFlight:
    """A completions request whose prompts are generating, and what both response shapes
    need to report them. Choice ``i`` belongs to prompt ``i // n``.

    Attributes:
        num_top: the request's ``logprobs`` (top alternatives per token); ``None``: the
            response carries no logprobs.
        echoed: per prompt, the text each of its choices starts with (``""`` without echo).
    """

    state: ServerState
    req: CompletionRequest
    gens: list[Generation]
    request_id: str
    created: int
    n: int
    num_top: int | None
    echoed: list[str]

    @property
    def num_choices(self) -> int:
        """``n`` choices per prompt."""
        return self.n * len(self.gens)

    @property
    def want_logprobs(self) -> bool:
        """True when every choice carries logprobs."""
        return self.num_top is not None

    def _echo_logprobs(self, i: int) -> CompletionLogProbs | None:
        """Choice ``i``'s echoed prompt logprobs (after its generation's first delta)."""
        if not (self.req.echo and self.want_logprobs):
            return None
        gen = self.gens[i // self.n]
        return echo_logprobs(self.state.tokenizer, gen.prompt_token_ids, gen.prompt_logprobs,
                             self.num_top)

    def _chunk(self, choices: list[CompletionResponseStreamChoice],
               usage: UsageInfo | None = None) -> str:
        """One stream chunk as JSON."""
        return CompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.state.model_name,
            choices=choices, usage=usage, system_fingerprint=self.state.system_fingerprint,
        ).model_dump_json()

    async def chunks(self) -> AsyncIterator[str]:
        """The stream's chunks: with echo, each choice's prompt (and its logprobs) first,
        then its text deltas, and a last ``usage`` chunk when ``include_usage`` asks."""
        n, echoed, want_logprobs = self.n, self.echoed, self.want_logprobs
        echo_pending = set(range(self.num_choices)) if self.req.echo else set()
        # text_offset counts from the start of each choice's whole text
        offsets = [len(echoed[i // n]) for i in range(self.num_choices)]
        async for ev in _merged(self.gens, n):
            if ev.index in echo_pending:  # the prompt (and its logprobs) come first
                echo_pending.discard(ev.index)
                yield self._chunk([CompletionResponseStreamChoice(
                    index=ev.index, text=echoed[ev.index // n],
                    logprobs=self._echo_logprobs(ev.index))])
            if not ev.text and ev.finish_reason is None and not want_logprobs:
                continue
            lp = None
            if want_logprobs:
                lp = completion_logprobs(self.state.tokenizer, ev.logprobs,
                                         offset=offsets[ev.index])
                if lp is not None:
                    offsets[ev.index] += sum(len(t) for t in lp.tokens)
            yield self._chunk([CompletionResponseStreamChoice(
                index=ev.index, text=ev.text, finish_reason=ev.finish_reason, logprobs=lp)])
        if self.req.include_usage:
            yield self._chunk([], usage=_usage(self.gens))

    async def response(self) -> CompletionResponse:
        """The whole response, once every choice has finished.

        Raises:
            APIError: a worker's failure while generating (see :func:`~pdserve.server.serving_common.worker_error`).
        """
        n, num_choices = self.n, self.num_choices
        texts, lps, finish = await collect_choices(
            _merged(self.gens, n), [self.echoed[i // n] for i in range(num_choices)])
        choices = [CompletionResponseChoice(
            index=i, text=texts[i], finish_reason=finish[i],
            logprobs=_joined(self._echo_logprobs(i), completion_logprobs(
                self.state.tokenizer, lps[i], offset=len(self.echoed[i // n])))
            if self.want_logprobs else None)
            for i in range(num_choices)]
        return CompletionResponse(id=self.request_id, created=self.created,
                                  model=self.state.model_name, choices=choices,
                                  usage=_usage(self.gens),
                                  system_fingerprint=self.state.system_fingerprint)
