"""OpenAI response bodies as pydantic models, shaped so the official ``openai`` client parses them.

Serialize with ``.model_dump_json()``: ``None`` fields go out as ``null`` (``usage`` is
``null`` in every stream chunk but the last one of an ``include_usage`` stream), except in
``DeltaMessage``, which, like OpenAI's, leaves out the fields a chunk does not carry.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from pdserve.server.protocol_common import LogProb, random_id

#: Why a choice ended: a stop string / EOS / stop token, the ``max_tokens`` cap, or (chat)
#: an answer that is tool calls.
FinishReason = Literal["stop", "length", "tool_calls"]


def _now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    """Breakdown of prompt tokens; ``cached_tokens`` were served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one response (OpenAI ``CompletionUsage``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


# ---------------------------------------------------------------- chat completions


class FunctionCallResponse(BaseModel):
    """The function a tool call invokes; ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallResponse


class ChatMessage(BaseModel):
    """The assistant message of a non-streamed chat choice (``content`` None when the answer
    is only tool calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class DeltaFunctionCall(BaseModel):
    """A streamed piece of a call's function: its name once, then arguments text."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(BaseModel):
    """A streamed piece of tool call ``index``: id, type and name on its first delta."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionTopLogprob(BaseModel):
    """One of the most likely tokens at a position, with its logprob."""

    token: str
    logprob: LogProb
    bytes: list[int] | None = None


class ChatCompletionLogProb(BaseModel):
    """The sampled token at one position, its logprob, and the top alternatives."""

    token: str
    logprob: LogProb
    bytes: list[int] | None = None
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    """Logprobs of a chat choice (or of the tokens in one stream chunk)."""

    content: list[ChatCompletionLogProb] | None = None


class ChatCompletionResponseChoice(BaseModel):
    """One choice of a non-streamed chat completion: the whole assistant message."""

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    """Body of a non-streamed ``/v1/chat/completions`` response."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    """The new part of a streamed chat message; unset fields are left out of the JSON.

    The first chunk of a choice carries ``role="assistant"`` (and ``content=""``), later
    ones only ``content``, and the last one may be empty (``{}``) beside ``finish_reason``.
    """

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionResponseStreamChoice(BaseModel):
    """One choice's part of a stream chunk; ``finish_reason`` is set on its last one."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One ``data:`` chunk of a streamed chat completion.

    Every chunk of a stream shares ``id`` and ``created``; the usage-only last chunk of an
    ``include_usage`` stream has ``choices=[]``.
    """

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---------------------------------------------------------------- text completions


class CompletionLogProbs(BaseModel):
    """Logprobs of a text completion choice, one entry per token of its text in each list.

    ``text_offset[i]`` is the character offset of ``tokens[i]`` in the choice's text;
    ``top_logprobs[i]`` maps each of the most likely tokens at position ``i`` to its logprob.
    With ``echo`` the prompt's tokens come first, and the very first one, which nothing
    predicts, has ``null`` in ``token_logprobs`` and ``top_logprobs`` (as OpenAI sends).
    """

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[LogProb | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, LogProb] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    """One choice of a non-streamed text completion (echoed prompt included)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    """Body of a non-streamed ``/v1/completions`` response."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionResponseStreamChoice(BaseModel):
    """One choice's new text in a stream chunk; ``finish_reason`` is set on its last one."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason | None = None


class CompletionStreamResponse(BaseModel):
    """One ``data:`` chunk of a streamed text completion (same ``object`` as the full one)."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---------------------------------------------------------------- models


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``; ``max_model_len`` is a vLLM-style extension."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now_s)
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """Body of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
