"""Shared steps of the chat and completion handlers: parse, check, submit, stream."""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import AsyncIterator, TypeVar

from pydantic import BaseModel, ValidationError

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.structured_output import (
    StructuredOutputParams,
    validate_structured_output,
)
from pdserve.router.router import NoWorkerAvailable, RequestRejected, WorkerFailed
from pdserve.server.errors import APIError
from pdserve.server.generation import Generation, submit
from pdserve.server.protocol import error_body, validation_error_to_body
from pdserve.server.state import ServerState

RequestT = TypeVar("RequestT", bound=BaseModel)


class BadRequest(APIError):
    """A 400 whose body came from a pydantic validation error."""

    def __init__(self, body: dict) -> None:
        err = body["error"]
        super().__init__(400, err["message"], err.get("param"), err.get("code"))


def parse_request(model_cls: type[RequestT], raw: bytes) -> RequestT:
    """Validate a JSON body. Raises :class:`APIError` 400 naming the bad parameter."""
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as exc:
        raise BadRequest(validation_error_to_body(exc)) from None


def check_model(state: ServerState, model: str | None) -> None:
    """Raises APIError 404 for a model name this server does not serve."""
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                            f"`{state.model_name}`.", "model", "model_not_found")


#: Bodies up to this size are parsed and tokenized on the event loop (~10 ms at most);
#: larger ones on :data:`_tokenizer_thread`, so that they neither stall the loop (a prompt
#: of 2M characters held ``/health`` and every stream for 1.6-7 s) nor queue the small
#: requests behind them (one behind a few large ones: 0.17 -> 7.8 s).
INLINE_BODY_BYTES = 16 * 1024
#: One thread: transformers tokenizers are not documented as safe to call from two at once
#: (the event loop's own tokenizer calls only read, as this thread's do).
_tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")


async def off_loop(raw: bytes, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` for the request whose body is ``raw``: inline when the body
    is at most :data:`INLINE_BODY_BYTES`, else on the tokenizer thread; its result or
    exception either way."""
    if len(raw) <= INLINE_BODY_BYTES:
        return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(
        _tokenizer_thread, partial(fn, *args, **kwargs))


def check_prompt_chars(state: ServerState, num_chars: int, prompt_param: str) -> None:
    """Raises APIError 400 (``context_length_exceeded``), before anything is tokenized, when
    a prompt of ``num_chars`` characters cannot fit the context whatever its tokens are (no
    token stands for more than :attr:`ServerState.max_token_chars` characters)."""
    least = -(-num_chars // state.max_token_chars)
    if least >= state.max_model_len:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} "
                            f"tokens, but the prompt's {num_chars} characters are at least "
                            f"{least} tokens.", prompt_param, "context_length_exceeded")


def check_prompt_length(limit: int, num_prompt_tokens: int, max_tokens: int | None,
                        prompt_param: str, is_default: bool = False) -> None:
    """Raises APIError 400 when prompt (+ max_tokens) does not fit the context of ``limit``
    tokens (the server's ``max_model_len``, read on the event loop).

    ``prompt_param`` names the request field that holds the prompt (``messages`` or
    ``prompt``), reported as the error's ``param`` when the prompt alone is too long;
    ``is_default``: the client sent no ``max_tokens`` (completions' default, 16), which
    the message then says.
    """
    if num_prompt_tokens >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens, but the "
                            f"prompt has {num_prompt_tokens} tokens.", prompt_param,
                       "context_length_exceeded")
    if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt "
                            f"({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}"
                            f"{', the default' if is_default else ''}) exceeds "
                            "it.", "max_tokens", "context_length_exceeded")


def to_params(state: ServerState, req, num_prompt_tokens: int, prompt_param: str):
    """The one OpenAI -> engine conversion, with its errors turned into 400s.

    The context length is checked first: the default ``max_tokens`` is the room the prompt
    leaves, which must be positive before it can become a ``SamplingParams``.
    """
    max_tokens, limit = req.max_tokens_requested, state.max_model_len
    is_default = not {"max_tokens", "max_completion_tokens"} & req.model_fields_set
    check_prompt_length(limit, num_prompt_tokens, max_tokens, prompt_param, is_default)
    room = limit - num_prompt_tokens
    if max_tokens is None and req.min_tokens > room:
        raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds the {room} tokens the "
                            f"context leaves after the prompt", "min_tokens")
    try:
        constraint = req.structured_output()
    except ValueError as exc:
        raise APIError(400, str(exc), req.structured_output_param) from None
    try:
        params = req.to_sampling_params(default_max_tokens=room)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    if params.n > state.max_n:
        raise APIError(400, f"n must be at most {state.max_n}", "n")
    vocab = getattr(state.tokenizer, "vocab_size", None)
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("stop_token_ids", params.stop_token_ids)):
        if vocab and any(t >= len(state.tokenizer) for t in ids):
            raise APIError(400, f"{name} contains a token id outside the vocabulary", name)
    return params


#: Seconds a constraint may take to compile on the API server before it is refused. Typical
#: schemas compile in milliseconds; a pattern such as ``(a|b){1,8000}`` takes tens of seconds.
GRAMMAR_CHECK_TIMEOUT_S = 2.0
#: Threads that compile constraints for checking (xgrammar releases the GIL while it
#: compiles, so the event loop runs on meanwhile).
_grammar_checks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")


async def check_structured_output(constraint: StructuredOutputParams | None,
                                  param: str) -> None:
    """Raises APIError 400 naming ``param`` when ``constraint`` would not compile, uses a
    JSON schema keyword that would not be enforced (the message names the keyword), or
    takes longer than :data:`GRAMMAR_CHECK_TIMEOUT_S` to compile. The compile runs off the
    event loop, so other requests and ``/health`` are served meanwhile."""
    if constraint is None:
        return
    future = asyncio.get_running_loop().run_in_executor(
        _grammar_checks, validate_structured_output, constraint)
    try:
        await asyncio.wait_for(asyncio.shield(future), GRAMMAR_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(400, f"the {constraint.kind.value} constraint does not compile within "
                            f"{GRAMMAR_CHECK_TIMEOUT_S:g} s; simplify it (for example "
                            "smaller repetition bounds in patterns)", param) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None


#: Longest a request that arrives while ``serve`` starts its workers waits for them (seconds)
#: before routing answers it (503 when no worker can take it). ``serve`` opens its port
#: before the model is loaded (``/health`` is the readiness probe); a client that sends
#: at once is served when the workers are ready, not told to retry.
STARTUP_WAIT_S = 120.0

#: How often a held request checks whether the workers registered (seconds).
STARTUP_POLL_S = 0.05


async def wait_for_start(state: ServerState) -> None:
    """Hold a request while the workers ``serve`` started have not all registered yet
    (:attr:`ServerState.num_workers_expected`), until they have, the server drains, or
    :data:`STARTUP_WAIT_S` passes. Returns at once on a server that started its workers
    (or has none of its own: ``pdserve server``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_WAIT_S
    registered = state.router.registry.ever_registered
    while (len(registered) < state.num_workers_expected and not state.draining
           and loop.time() < deadline):
        await asyncio.sleep(STARTUP_POLL_S)


def start_generation(state: ServerState, prefix: str, prompt_token_ids: list[int], params,
                     stop: list[str], include_stop: bool = False) -> tuple[str, Generation]:
    """Submit; raises APIError 503 when no worker can take it."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    try:
        gen = submit(state.router, state.metrics, state.tokenizer, request_id,
                     prompt_token_ids, params, stop, include_stop)
    except NoWorkerAvailable as exc:
        raise APIError(503, str(exc), code="no_worker_available") from None
    return request_id, gen


def worker_error(exc: Exception) -> APIError:
    """Map a failure reported while streaming to an APIError."""
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc))
    if isinstance(exc, WorkerFailed):
        return APIError(503, str(exc), code="worker_failed")
    return APIError(500, "internal server error")


async def collect_choices(events: AsyncIterator, texts: list[str]) -> tuple[
        list[str], list[list[TokenLogprob] | None], list[str | None]]:
    """Fold a request's streamed choice events into whole choices (a non-streamed response).

    Args:
        events: ``ChoiceEvent`` objects (``index``, ``text``, ``logprobs``,
            ``finish_reason``) of all the request's choices, interleaved.
        texts: each choice's starting text (an echoed prompt, or ""); extended in place.

    Returns:
        ``(texts, logprobs, finish_reasons)`` per choice; a choice's logprobs are None when
        none were asked for.

    Raises:
        APIError: a worker's failure while generating (:func:`worker_error`).
    """
    logprobs: list[list[TokenLogprob] | None] = [None] * len(texts)
    finish: list[str | None] = [None] * len(texts)
    try:
        async for ev in events:
            texts[ev.index] += ev.text
            if ev.logprobs is not None:
                logprobs[ev.index] = (logprobs[ev.index] or []) + list(ev.logprobs)
            if ev.finish_reason is not None:
                finish[ev.index] = ev.finish_reason
    except Exception as exc:
        raise worker_error(exc) from None
    return texts, logprobs, finish


async def sse(chunks: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """Frame JSON chunks as server-sent events, ending with ``data: [DONE]``.

    A failure mid-stream becomes one error event (the HTTP status is already 200).
    """
    try:
        async for chunk in chunks:
            yield f"data: {chunk}\n\n".encode()
    except (RequestRejected, WorkerFailed) as exc:
        err = worker_error(exc)
        body = error_body(err.message, "invalid_request_error" if err.status == 400
                          else "service_unavailable", err.param, err.code)
        yield f"data: {json.dumps(body)}\n\n".encode()
    yield b"data: [DONE]\n\n"
