"""``POST /v1/chat/completions``: stream and non-stream."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallResponse,
    PromptTokensDetails,
    ToolCall,
    UsageInfo,
)
from pdserve.server.serving_common import (
    check_model,
    check_prompt_chars,
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
from pdserve.server.tools.grammar import tool_call_constraint
from pdserve.server.tools.parsers import StreamDelta, ToolCallParser, get_tool_parser
from pdserve.server.tools.prompt import render_messages


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest,
                    add_generation_prompt: bool = True) -> list[int]:
    """Apply the model's chat template (tools rendered, the assistant's turn opened unless
    ``add_generation_prompt`` is false, the last assistant message left open with
    ``continue_final_message``, ``chat_template_kwargs`` passed on) and tokenize.

    Raises:
        APIError: 400 when the template refuses the conversation.
    """
    messages, kwargs = render_messages(req, getattr(state.tokenizer, "chat_template", None))
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        out = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs,
            **(req.chat_template_kwargs or {}))
    except Exception as exc:  # a template may raise on role order etc.
        raise APIError(400, f"chat template could not be applied: {exc}", "messages") from None
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """The bytes token ``token_id`` (decoded: ``text``) stands for, also when it holds only
    part of a character (its text then decodes to U+FFFD): byte-level BPE pieces map back
    through GPT-2's alphabet, SentencePiece byte-fallback pieces (``<0xE2>``) are their
    byte. OpenAI's ``bytes`` exist so that a client can join such pieces."""
    if "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return [int(piece[3:5], 16)]
    alphabet = _byte_level_alphabet()
    if all(char in alphabet for char in piece):
        return [alphabet[char] for char in piece]
    return list(text.encode())


def chat_logprobs(tokenizer, lps: list[TokenLogprob] | None) -> ChatCompletionLogProbs | None:
    """Logprobs of generated tokens in the chat shape: each token's text, logprob, UTF-8
    bytes and top alternatives; ``None`` when there are none."""
    if not lps:
        return None
    content = []
    for lp in lps:
        text = _token_text(tokenizer, lp.token_id)
        top = []
        for tid, val in zip(lp.top_token_ids, lp.top_logprobs):
            t = _token_text(tokenizer, tid)
            top.append(ChatCompletionTopLogprob(token=t, logprob=val,
                                                bytes=token_bytes(tokenizer, tid, t)))
        content.append(ChatCompletionLogProb(token=text, logprob=lp.logprob,
                                             bytes=token_bytes(tokenizer, lp.token_id, text),
                                             top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def _usage(gen: Generation) -> UsageInfo:
    return UsageInfo(prompt_tokens=gen.num_prompt_tokens,
                     completion_tokens=gen.num_completion_tokens,
                     total_tokens=gen.num_prompt_tokens + gen.num_completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=gen.num_cached_tokens))


def _tool_params(state: ServerState, req: ChatCompletionRequest, params: SamplingParams
                 ) -> tuple[SamplingParams, ToolCallParser | None]:
    """The request's params with the tool-call grammar (``required`` / named) and the
    parser that reads calls from the output (None when the request has no tools)."""
    if not req.tools or req.tool_choice_name == "none":
        return params, None
    try:
        constraint = tool_call_constraint(req)
    except ValueError as exc:
        raise APIError(400, str(exc), "tools") from None
    if constraint is not None and params.structured_output is not None \
            and req.tool_choice_name == "auto":
        raise APIError(400, "response_format together with tools that constrain the output "
                       "under tool_choice auto (a strict function, or parallel_tool_calls "
                       "false) is not supported", "response_format")
    if constraint is not None:
        params = dataclasses.replace(params, structured_output=constraint)
    state.metrics.observe_tool_request(req.tool_choice_name)
    return params, get_tool_parser(state.tool_parser)


def _message(text: str, parser: ToolCallParser | None, finish_reason: str | None,
             state: ServerState) -> tuple[ChatMessage, str | None]:
    """The assistant message of a finished choice, tool calls parsed out of its text."""
    if parser is None:
        return ChatMessage(role="assistant", content=text), finish_reason
    parsed = parser.parse(text)
    state.metrics.observe_tool_parse(len(parsed.tool_calls), parsed.num_failed)
    if not parsed.tool_calls:
        return ChatMessage(role="assistant", content=text), finish_reason
    calls = [ToolCall(id=c.id, function=FunctionCallResponse(name=c.name, arguments=c.arguments))
             for c in parsed.tool_calls]
    if finish_reason == "stop":
        finish_reason = "tool_calls"
    return ChatMessage(role="assistant", content=parsed.content, tool_calls=calls), finish_reason


async def create_chat_completion(state: ServerState, raw: bytes):
    """``POST /v1/chat/completions``: ``n`` choices of the assistant's next turn, streamed
    or in one body, tool calls parsed out of the text when the request offers tools.

    Raises:
        APIError: 400 for an invalid request (``param`` names the field), 404 for a model
            this server does not serve, 503 when no worker can take it.
    """
    req = await off_loop(raw, parse_request, ChatCompletionRequest, raw)
    check_model(state, req.model)
    # assistant turns are left out of the bound: a template may drop their reasoning
    check_prompt_chars(state, sum(len(m.text) for m in req.messages if m.role != "assistant"),
                       "messages")
    prompt_ids = await off_loop(raw, chat_prompt_ids, state, req, req.add_generation_prompt)
    params = to_params(state, req, len(prompt_ids), "messages")
    from_response_format = params.structured_output
    params, parser = _tool_params(state, req, params)
    await check_structured_output(
        params.structured_output,
        req.structured_output_param if params.structured_output is from_response_format
        else "tools")
    if params.structured_output is not None:
        state.metrics.observe_structured_output(params.structured_output.kind.value)
    await wait_for_start(state)
    request_id, gen = start_generation(state, "chatcmpl", prompt_ids, params, req.stop_list,
                                       req.include_stop_str_in_output)
    created = int(time.time())
    if req.stream:
        return StreamingResponse(
            sse(_stream(state, req, gen, request_id, created, req.include_usage, params.n,
                        parser)),
            media_type="text/event-stream")

    texts, logprobs, finish = await collect_choices(gen.events(), [""] * params.n)
    want_logprobs = params.logprobs is not None
    choices = []
    for i in range(params.n):
        message, finish_reason = _message(texts[i], parser, finish[i], state)
        choices.append(ChatCompletionResponseChoice(
            index=i, message=message,
            logprobs=chat_logprobs(state.tokenizer, logprobs[i]) if want_logprobs else None,
            finish_reason=finish_reason))
    resp = ChatCompletionResponse(
        id=request_id, created=created, model=state.model_name, choices=choices,
        usage=_usage(gen), system_fingerprint=state.system_fingerprint)
    return JSONResponse(resp.model_dump(mode="json"))


def _tool_deltas(delta: StreamDelta) -> list[DeltaToolCall] | None:
    if not delta.tool_calls:
        return None
    return [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                          function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
            for d in delta.tool_calls]


async def _stream(state: ServerState, req: ChatCompletionRequest, gen: Generation,
                  request_id: str, created: int, include_usage: bool,
                  n: int, parser: ToolCallParser | None = None) -> AsyncIterator[str]:
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
    streams = [parser.stream() if parser is not None else None for _ in range(n)]
    async for ev in gen.events():
        stream = streams[ev.index]
        finish_reason = ev.finish_reason
        if stream is None:
            delta = DeltaMessage(content=ev.text)
            has_text = bool(ev.text)
        else:
            parsed = stream.feed(ev.text)
            if finish_reason is not None:
                tail = stream.finish()
                parsed = StreamDelta(parsed.content + tail.content,
                                     parsed.tool_calls + tail.tool_calls)
                state.metrics.observe_tool_parse(stream.num_calls, stream.num_failed)
                if stream.num_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            delta = DeltaMessage(content=parsed.content or None,
                                 tool_calls=_tool_deltas(parsed))
            has_text = bool(parsed.content or parsed.tool_calls)
        if not has_text and finish_reason is None and not want_logprobs:
            continue  # tokens held back (partial character, stop string, tool-call tag)
        yield chunk([ChatCompletionResponseStreamChoice(
            index=ev.index, delta=delta,
            logprobs=chat_logprobs(state.tokenizer, ev.logprobs) if want_logprobs else None,
            finish_reason=finish_reason)])
    if include_usage:
        yield chunk([], usage=_usage(gen))
