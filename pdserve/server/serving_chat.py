"""``POST /v1/chat/completions``: stream and non-stream."""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.engine.outputs import TokenLogprob
from pdserve.server.errors import APIError
from pdserve.server.generation import Generation
from pdserve.server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTopLogprob,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
)
from pdserve.server.serving_common import (
    check_model,
    parse_request,
    sse,
    start_generation,
    to_params,
    worker_error,
)
from pdserve.server.state import ServerState


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """Apply the model's chat template (generation prompt added) and tokenize."""
    try:
        out = state.tokenizer.apply_chat_template(
            req.text_messages(), add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # a template may raise on role order etc.
        raise APIError(400, f"chat template could not be applied: {exc}", "messages") from None
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer, lps: list[TokenLogprob] | None) -> ChatCompletionLogProbs | None:
    if not lps:
        return None
    content = []
    for lp in lps:
        text = _token_text(tokenizer, lp.token_id)
        top = []
        for tid, val in zip(lp.top_token_ids, lp.top_logprobs):
            t = _token_text(tokenizer, tid)
            top.append(ChatCompletionTopLogprob(token=t, logprob=val, bytes=list(t.encode())))
        content.append(ChatCompletionLogProb(token=text, logprob=lp.logprob,
                                             bytes=list(text.encode()), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def _usage(gen: Generation) -> UsageInfo:
    return UsageInfo(prompt_tokens=gen.num_prompt_tokens,
                     completion_tokens=gen.num_completion_tokens,
                     total_tokens=gen.num_prompt_tokens + gen.num_completion_tokens)


async def create_chat_completion(state: ServerState, raw: bytes):
    req = parse_request(ChatCompletionRequest, raw)
    check_model(state, req.model)
    prompt_ids = chat_prompt_ids(state, req)
    params = to_params(state, req, len(prompt_ids), "messages")
    request_id, gen = start_generation(state, "chatcmpl", prompt_ids, params, req.stop_list)
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            sse(_stream(state, req, gen, request_id, created, include_usage, params.n)),
            media_type="text/event-stream")

    texts = [""] * params.n
    logprobs: list[list[TokenLogprob] | None] = [None] * params.n
    finish: list[str | None] = [None] * params.n
    try:
        async for ev in gen.events():
            texts[ev.index] += ev.text
            if ev.logprobs is not None:
                logprobs[ev.index] = (logprobs[ev.index] or []) + list(ev.logprobs)
            if ev.finish_reason is not None:
                finish[ev.index] = ev.finish_reason
    except Exception as exc:
        raise worker_error(exc) from None
    want_logprobs = params.logprobs is not None
    choices = [
        ChatCompletionResponseChoice(
            index=i, message=ChatMessage(role="assistant", content=texts[i]),
            logprobs=chat_logprobs(state.tokenizer, logprobs[i]) if want_logprobs else None,
            finish_reason=finish[i])
        for i in range(params.n)
    ]
    resp = ChatCompletionResponse(
        id=request_id, created=created, model=state.model_name, choices=choices,
        usage=_usage(gen), system_fingerprint=state.system_fingerprint)
    return JSONResponse(resp.model_dump(mode="json"))


async def _stream(state: ServerState, req: ChatCompletionRequest, gen: Generation,
                  request_id: str, created: int, include_usage: bool,
                  n: int) -> AsyncIterator[str]:
    def chunk(choices, usage=None) -> str:
        return ChatCompletionStreamResponse(
            id=request_id, created=created, model=state.model_name, choices=choices,
            usage=usage, system_fingerprint=state.system_fingerprint,
        ).model_dump_json(exclude_unset=False)

    for i in range(n):
        yield chunk([ChatCompletionResponseStreamChoice(
            index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
            finish_reason=None)])
    want_logprobs = req.logprobs
    async for ev in gen.events():
        if not ev.text and ev.finish_reason is None and not want_logprobs:
            continue  # tokens held back (partial character or possible stop string)
        yield chunk([ChatCompletionResponseStreamChoice(
            index=ev.index, delta=DeltaMessage(content=ev.text),
            logprobs=chat_logprobs(state.tokenizer, ev.logprobs) if want_logprobs else None,
            finish_reason=ev.finish_reason)])
    if include_usage:
        yield chunk([], usage=_usage(gen))
