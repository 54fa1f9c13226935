"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) as pydantic models.

The fields both share (sampling, stop strings, streaming, output constraints) and their
conversion to the engine's ``SamplingParams`` live in :mod:`protocol_sampling`.

Validation follows the OpenAI API: a wrong type or out-of-range value raises a pydantic
``ValidationError`` whose location names the parameter (``messages.0.role``). Unknown
fields are accepted and ignored, and ``null`` means "use the default" for every field
whose type has no ``None`` of its own.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdserve.server.protocol_common import (
    MAX_COMPLETION_LOGPROBS,
    MAX_TOP_LOGPROBS,
    Int,
    param_error,
)
from pdserve.server.protocol_sampling import SamplingRequest, StreamOptions
from pdserve.server.protocol_structured import (
    ChatCompletionMessageToolCall,
    ChatCompletionToolParam,
    ToolChoice,
)

__all__ = [
    "ChatCompletionContentPartText",
    "ChatCompletionRequest",
    "ChatCompletionRequestMessage",
    "ChatRole",
    "CompletionRequest",
    "Prompt",
    "StreamOptions",
]

#: Roles a chat message may have.
ChatRole = Literal["system", "user", "assistant", "developer", "tool"]

#: A completions prompt: text, a batch of texts, token ids, or a batch of token ids.
Prompt = str | list[str] | list[int] | list[list[int]]


def _is_token_id(value: Any) -> bool:
    """True for a JSON integer >= 0 (booleans are not token ids)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class ChatCompletionContentPartText(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"] = "text"
    text: str


class ChatCompletionRequestMessage(BaseModel):
    """One chat message: a role and its content (text, or a list of text parts)."""

    model_config = ConfigDict(extra="ignore")

    role: ChatRole
    content: str | list[ChatCompletionContentPartText] | None = Field(None, validate_default=True)
    tool_calls: list[ChatCompletionMessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatCompletionRequestMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None:
            if role == "assistant":  # an assistant turn may carry tool calls and no text
                return None
            raise ValueError(f"content is required for a {role or 'chat'} message")
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("content must be a string or a non-empty list of text content parts")
        for i, part in enumerate(value):
            if isinstance(part, ChatCompletionContentPartText):
                continue
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"content[{i}] must be a text part with type 'text'; "
                    f"got {kind!r} (only text content is supported)"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content[{i}].text must be a string")
        return value

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined with newlines (as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatCompletionRequestMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = Field(True, description="extension")
    continue_final_message: StrictBool = Field(False, description="extension")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extension")

    REFUSED_FIELDS: typing.ClassVar[dict[str, Any]] = {
        # vLLM's chat extensions not served here
        "echo": lambda value: value is False,
        "chat_template": None,  # a request's own template (vLLM too refuses it by default)
        "documents": None,
        "mm_processor_kwargs": None,
        "add_special_tokens": lambda value: value is False,
        "audio": None,
        "modalities": lambda value: value == ["text"],
        "web_search_options": None,
        "functions": None,  # deprecated: send tools
        "function_call": None,  # deprecated: send tool_choice
        "reasoning_effort": None,
        "verbosity": None,
        "logprobs_format": None,
    }

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise param_error(type(self).__name__, "tools", "tool names must be unique", names)
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            message = f"tool_choice {self.tool_choice_name!r} needs tools"
            raise param_error(type(self).__name__, "tool_choice", message, None)
        if not isinstance(choice, str) and choice is not None \
                and choice.function.name not in names:
            message = f"tool_choice names {choice.function.name!r}, which is not in tools"
            raise param_error(type(self).__name__, "tool_choice", message, None)
        if self.tool_choice_name in ("required", "named") and self.structured_output() is not None:
            message = f"tool_choice {self.tool_choice_name!r} cannot be combined with another " \
                      "output constraint (response_format / structured_outputs)"
            raise param_error(type(self).__name__, "tool_choice", message, None)
        return self

    @model_validator(mode="after")
    def _check_template_fields(self) -> ChatCompletionRequest:
        """vLLM's rules: a final assistant message is continued only without a generation
        prompt; template keyword arguments may not replace the ones the server passes."""
        name = type(self).__name__
        if self.continue_final_message and (
                self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise param_error(name, "continue_final_message", "continue_final_message needs "
                              "add_generation_prompt false and a last message from the "
                              "assistant", True)
        taken = {"messages", "conversation", "tools", "tokenize", "add_generation_prompt",
                 "continue_final_message", "chat_template", "documents", "return_dict"}
        clash = sorted(taken & set(self.chat_template_kwargs or {}))
        if clash:
            raise param_error(name, "chat_template_kwargs", f"chat_template_kwargs may not "
                              f"set {clash}", clash)
        return self

    @model_validator(mode="after")
    def _check_tool_results(self) -> ChatCompletionRequest:
        """A ``tool`` message answers a call made earlier in the conversation, once (OpenAI:
        "Duplicate value for 'tool_call_id'"); an id called again may be answered again."""
        called: set[str] = set()
        answered: dict[str, int] = {}  # call id -> the message that answered it
        for i, message in enumerate(self.messages):
            for call in message.tool_calls or []:
                called.add(call.id)
                answered.pop(call.id, None)
            if message.role != "tool":
                continue
            call_id, where = message.tool_call_id, f"messages.{i}.tool_call_id"
            if call_id not in called:
                raise param_error(type(self).__name__, where,
                                  f"a tool message must answer a tool call of an earlier "
                                  f"assistant message; {call_id!r} is none", call_id)
            if call_id in answered:
                raise param_error(type(self).__name__, where,
                                  f"duplicate value for tool_call_id {call_id!r}: "
                                  f"messages.{answered[call_id]} answers that call already",
                                  call_id)
            answered[call_id] = i
        return self

    @property
    def tool_choice_name(self) -> str:
        """``none``, ``auto``, ``required`` or ``named``; tools default to ``auto``."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else "named"

    @model_validator(mode="after")
    def _check_top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            message = "top_logprobs requires logprobs to be true"
            raise param_error(type(self).__name__, "top_logprobs", message, self.top_logprobs)
        return self

    @property
    def max_tokens_requested(self) -> int | None:
        """``max_completion_tokens`` if given (it supersedes ``max_tokens``), else that."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """``top_logprobs`` (0 when omitted) if ``logprobs`` is true, else ``None``."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def text_messages(self) -> list[dict[str, str]]:
        """The conversation as ``{"role", "content"}`` dicts (tool calls left out)."""
        return [{"role": message.role, "content": message.text} for message in self.messages]


class CompletionRequest(SamplingRequest):
    """Body of ``POST /v1/completions`` (the legacy text completions API)."""

    prompt: Prompt
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: Int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    best_of: Int | None = Field(None, ge=1)
    suffix: str | None = None

    REFUSED_FIELDS: typing.ClassVar[dict[str, Any]] = {
        "suffix": lambda value: value == "",
    }

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            message = (f"best_of ({self.best_of}) must equal n ({self.n}): returning the best "
                       "of more candidates than n is not supported")
            raise param_error(type(self).__name__, "best_of", message, self.best_of)
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(
                "prompt must be a non-empty string, list of strings, list of token ids, "
                "or list of token-id lists"
            )
        if all(isinstance(p, str) for p in value):
            if any(not p for p in value):
                raise ValueError("prompt strings must not be empty")
        elif all(isinstance(p, list) for p in value):
            if any(not p or not all(_is_token_id(t) for t in p) for p in value):
                raise ValueError("each token-id prompt must be a non-empty list of ids >= 0")
        elif not all(_is_token_id(t) for t in value):
            raise ValueError(
                "prompt lists must hold only strings, only token ids >= 0, "
                "or only token-id lists"
            )
        return value

    @property
    def max_tokens_requested(self) -> int | None:
        """``max_tokens``; ``null`` means OpenAI's default for completions (16), as an
        omitted field does."""
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """``logprobs``: the top alternatives per token (0: only the sampled token's)."""
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs``: the echoed prompt carries its tokens' logprobs."""
        return self.logprobs if self.echo else None

    @property
    def prompt_list(self) -> list[str | list[int]]:
        """The prompts of this request, each text or token ids (a single prompt → [it])."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)
