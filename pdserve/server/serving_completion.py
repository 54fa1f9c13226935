"""``POST /v1/completions``: one or several prompts, stream and non-stream."""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.engine.outputs import TokenLogprob
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
    check_structured_output,
    parse_request,
    sse,
    start_generation,
    to_params,
    worker_error,
)
from pdserve.server.state import ServerState


def prompt_id_lists(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt (strings are tokenized; id lists are range-checked)."""
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
        else:
            if any(t < 0 or t >= vocab for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
            out.append(list(p))
    if any(not ids for ids in out):
        raise APIError(400, "prompt must not be empty", "prompt")
    return out


def completion_logprobs(tokenizer, lps: list[TokenLogprob] | None, offset: int = 0
                        ) -> CompletionLogProbs | None:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        text = tokenizer.decode([lp.token_id])
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({tokenizer.decode([t]): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
        offsets.append(offset)
        offset += len(text)
    return CompletionLogProbs(text_offset=offsets, token_logprobs=token_lps, tokens=tokens,
                              top_logprobs=tops)


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
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogProbs(
        text_offset=offsets, tokens=tokens,
        token_logprobs=[None] + [lp.logprob for lp in lps],
        top_logprobs=[None] + [{tokenizer.decode([t]): v for t, v in zip(
            lp.top_token_ids[:num_top], lp.top_logprobs[:num_top])} for lp in lps])


def _joined(a: CompletionLogProbs | None, b: CompletionLogProbs | None
            ) -> CompletionLogProbs | None:
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
    p = sum(g.num_prompt_tokens for g in gens)
    c = sum(g.num_completion_tokens for g in gens)
    cached = sum(g.num_cached_tokens for g in gens)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def create_completion(state: ServerState, raw: bytes):
    req = parse_request(CompletionRequest, raw)
    check_model(state, req.model)
    prompts = prompt_id_lists(state, req)
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
    gens: list[Generation] = []
    request_id = ""
    try:
        for ids, params in zip(prompts, params_list):
            rid, gen = start_generation(state, "cmpl", ids, params, req.stop_list)
            request_id = request_id or rid
            gens.append(gen)
    except APIError:
        for g in gens:
            for c in g.choices:
                state.router.abort(c.handle.request_id)
        raise
    created = int(time.time())
    want_logprobs = params_list[0].logprobs is not None
    # echo: each choice's text starts with its prompt (given text, or decoded ids)
    echoed = [(p if isinstance(p, str) else state.tokenizer.decode(ids))
              if req.echo else "" for p, ids in zip(req.prompt_list, prompts)]
    num_top = params_list[0].logprobs

    def echo_part(i: int) -> CompletionLogProbs | None:
        """Choice ``i``'s echoed prompt logprobs (after its generation's first delta)."""
        if not (req.echo and want_logprobs):
            return None
        gen = gens[i // n]
        return echo_logprobs(state.tokenizer, gen.prompt_token_ids, gen.prompt_logprobs,
                             num_top)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks() -> AsyncIterator[str]:
            echo_pending = set(range(num_choices)) if req.echo else set()
            # text_offset counts from the start of each choice's whole text
            offsets = [len(echoed[i // n]) for i in range(num_choices)]
            async for ev in _merged(gens, n):
                if ev.index in echo_pending:  # the prompt (and its logprobs) come first
                    echo_pending.discard(ev.index)
                    yield CompletionStreamResponse(
                        id=request_id, created=created, model=state.model_name,
                        choices=[CompletionResponseStreamChoice(
                            index=ev.index, text=echoed[ev.index // n],
                            logprobs=echo_part(ev.index))],
                        system_fingerprint=state.system_fingerprint).model_dump_json()
                if not ev.text and ev.finish_reason is None and not want_logprobs:
                    continue
                lp = None
                if want_logprobs:
                    lp = completion_logprobs(state.tokenizer, ev.logprobs,
                                             offset=offsets[ev.index])
                    if lp is not None:
                        offsets[ev.index] += sum(len(t) for t in lp.tokens)
                yield CompletionStreamResponse(
                    id=request_id, created=created, model=state.model_name,
                    choices=[CompletionResponseStreamChoice(
                        index=ev.index, text=ev.text, finish_reason=ev.finish_reason,
                        logprobs=lp)],
                    system_fingerprint=state.system_fingerprint).model_dump_json()
            if include_usage:
                yield CompletionStreamResponse(
                    id=request_id, created=created, model=state.model_name, choices=[],
                    usage=_usage(gens), system_fingerprint=state.system_fingerprint,
                ).model_dump_json()

        return StreamingResponse(sse(chunks()), media_type="text/event-stream")

    texts = [echoed[i // n] for i in range(num_choices)]
    lps: list[list[TokenLogprob] | None] = [None] * num_choices
    finish: list[str | None] = [None] * num_choices
    try:
        async for ev in _merged(gens, n):
            texts[ev.index] += ev.text
            if ev.logprobs is not None:
                lps[ev.index] = (lps[ev.index] or []) + list(ev.logprobs)
            if ev.finish_reason is not None:
                finish[ev.index] = ev.finish_reason
    except Exception as exc:
        raise worker_error(exc) from None
    choices = [CompletionResponseChoice(
        index=i, text=texts[i], finish_reason=finish[i],
        logprobs=_joined(echo_part(i), completion_logprobs(
            state.tokenizer, lps[i], offset=len(echoed[i // n])))
        if want_logprobs else None)
        for i in range(num_choices)]
    resp = CompletionResponse(id=request_id, created=created, model=state.model_name,
                              choices=choices, usage=_usage(gens),
                              system_fingerprint=state.system_fingerprint)
    return JSONResponse(resp.model_dump(mode="json"))
