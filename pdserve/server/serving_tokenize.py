"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's request and response shapes.

``/tokenize`` takes either ``prompt`` (text) or ``messages`` (chat, rendered by the model's
template exactly as ``/v1/chat/completions`` renders it, tools included) and returns the
token ids the server would generate from; ``/detokenize`` turns ids back into text.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from pdserve.server.errors import APIError
from pdserve.server.protocol_common import Int
from pdserve.server.protocol_errors import validation_error_to_body
from pdserve.server.protocol_requests import ChatCompletionRequestMessage
from pdserve.server.protocol_structured import ChatCompletionToolParam
from pdserve.server.serving_common import BadRequest, check_model, off_loop, parse_request
from pdserve.server.state import ServerState


class TokenizeRequest(BaseModel):
    """Body of ``/tokenize``: ``prompt`` or ``messages``, not both."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatCompletionRequestMessage] | None = Field(None, min_length=1)
    tools: list[ChatCompletionToolParam] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = None  # default: True for prompt, False for chat
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    """Body of a ``/tokenize`` response: the ids, their number, the context length and,
    when asked, each id's token string."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


#: Most ids one ``/detokenize`` takes: the tokenizer holds the GIL while it decodes, so 2M
#: ids held ``/health`` and every stream for ~1 s even off the event loop.
MAX_DETOKENIZE_IDS = 1 << 17


class DetokenizeRequest(BaseModel):
    """Body of ``/detokenize``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Int] = Field(max_length=MAX_DETOKENIZE_IDS)


class DetokenizeResponse(BaseModel):
    """Body of a ``/detokenize`` response: the text of the ids."""

    prompt: str


def _chat_ids(state: ServerState, req: TokenizeRequest) -> list[int]:
    from pdserve.server.protocol_requests import ChatCompletionRequest
    from pdserve.server.serving_chat import chat_prompt_ids

    chat: dict[str, Any] = {"messages": [m.model_dump(exclude_none=True) for m in req.messages]}
    if req.tools:
        chat["tools"] = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools]
    try:  # the chat endpoint's own checks (a tool message must answer a call, ...)
        chat_req = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise BadRequest(validation_error_to_body(exc)) from None
    ids = chat_prompt_ids(state, chat_req, add_generation_prompt=req.add_generation_prompt)
    if req.add_special_tokens and state.tokenizer.bos_token_id is not None \
            and (not ids or ids[0] != state.tokenizer.bos_token_id):
        ids = [state.tokenizer.bos_token_id] + ids
    return ids


async def tokenize(state: ServerState, raw: bytes) -> JSONResponse:
    """``/tokenize``: the prompt's token ids (and their strings when asked)."""
    req = await off_loop(raw, parse_request, TokenizeRequest, raw)
    check_model(state, req.model)
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await off_loop(raw, state.tokenizer.encode, req.prompt,
                             add_special_tokens=add_special)
    else:
        ids = await off_loop(raw, _chat_ids, state, req)
    strs = (await off_loop(raw, state.tokenizer.convert_ids_to_tokens, ids)
            if req.return_token_strs else None)
    resp = TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                            token_strs=strs)
    return JSONResponse(resp.model_dump(mode="json"))


async def detokenize(state: ServerState, raw: bytes) -> JSONResponse:
    """``/detokenize``: the text of token ids.

    Raises:
        APIError: 400 for an id outside the vocabulary.
    """
    req = await off_loop(raw, parse_request, DetokenizeRequest, raw)
    check_model(state, req.model)
    vocab = len(state.tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[0]}", "tokens")
    text = await off_loop(raw, state.tokenizer.decode, req.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump(mode="json"))
