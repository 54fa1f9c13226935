"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) as pydantic models.

NOTE: ``to_sampling_params`` is the one place where an API request becomes the engine's
``SamplingParams``. Everything the engine does not see (stop strings, streaming, the
prompt itself) stays on the request and is read by the server.

Validation follows the OpenAI API: a wrong type or out-of-range value raises a pydantic
``ValidationError`` whose location names the parameter (``messages.0.role``). Unknown
fields are accepted and ignored, and ``null`` means "use the default" for every field
whose type has no ``None`` of its own.
"""

from __future__ import annotations

import types
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

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output import StructuredOutputParams
from pdserve.server.protocol_common import (
    MAX_ABS_LOGIT_BIAS,
    MAX_COMPLETION_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    MIN_SEED,
    Float,
    Int,
    param_error,
)
from pdserve.server.protocol_structured import (
    ChatCompletionMessageToolCall,
    ChatCompletionToolParam,
    ResponseFormat,
    StructuredOutputsOptions,
    ToolChoice,
)

#: Roles a chat message may have.
ChatRole = Literal["system", "user", "assistant", "developer", "tool"]

#: A completions prompt: text, a batch of texts, token ids, or a batch of token ids.
Prompt = str | list[str] | list[int] | list[list[int]]


def _admits_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits_none(arg) for arg in typing.get_args(annotation))
    return False


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk carrying ``usage``."""

    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = None  # null: the default (no usage chunk)


#: vLLM's older request fields -> their ``structured_outputs`` names.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def _refuse_fields(data: Any, refused: dict[str, Any]) -> None:
    """Raises naming the first field that would change the output and is not supported.

    ``refused`` maps a field to a predicate on its value that is true when the value is
    harmless (the default), or to None when any non-null value is refused.
    """
    if not isinstance(data, dict):
        return
    for name, harmless in refused.items():
        value = data.get(name)
        if value is None or (harmless is not None and harmless(value)):
            continue
        raise param_error("request", name, f"{name} is not supported by this server", value)


class _SamplingRequest(BaseModel):
    """Fields and conversion shared by chat and text completion requests."""

    model_config = ConfigDict(extra="ignore")

    # NOTE: field order matters: a field validator sees only the fields declared above it.
    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(0, ge=-1, description="extension; 0 or -1 disables top-k")
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    n: Int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=10.0, description="extension")
    logit_bias: dict[str, Float] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = Field(False, description="extension")
    min_tokens: Int = Field(0, ge=0, description="extension")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = Field(None, description="extension")
    user: str | None = None

    #: OpenAI fields that would change the output and that this server does not serve:
    #: field -> predicate true for a harmless value (None: any non-null value is refused).
    REFUSED_FIELDS: typing.ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if not (
                value is None
                and key in fields
                and not fields[key].is_required()
                and not _admits_none(fields[key].annotation)
            )
        }

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        _refuse_fields(data, cls.REFUSED_FIELDS)
        return data

    @model_validator(mode="before")
    @classmethod
    def _guided_fields(cls, data: Any) -> Any:
        """vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
        ``guided_grammar`` fields, read as ``structured_outputs`` (never ignored)."""
        if not isinstance(data, dict):
            return data
        guided = {key: data[key] for key in _GUIDED_FIELDS if data.get(key) is not None}
        if not guided:
            return data
        if data.get("structured_outputs") is not None:
            raise param_error("request", next(iter(guided)),
                              "send either structured_outputs or guided_* fields", None)
        data = {k: v for k, v in data.items() if k not in _GUIDED_FIELDS}
        data["structured_outputs"] = {_GUIDED_FIELDS[k]: v for k, v in guided.items()}
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(
                f"stop may hold at most {MAX_STOP_SEQUENCES} strings, got {len(stops)}"
            )
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token_id, bias in (value or {}).items():
            if not (token_id.isascii() and token_id.isdecimal()):
                raise ValueError(f"logit_bias keys must be token ids as strings, got {token_id!r}")
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                    f"{MAX_ABS_LOGIT_BIAS:g}], got {bias:g} for token {token_id}"
                )
        return value

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @model_validator(mode="after")
    def _one_structured_output(self) -> _SamplingRequest:
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            message = "response_format and structured_outputs cannot both constrain the output"
            raise param_error(type(self).__name__, "structured_outputs", message, None)
        return self

    @model_validator(mode="after")
    def _check_min_tokens(self) -> _SamplingRequest:
        max_tokens = self.max_tokens_requested
        if max_tokens is not None and self.min_tokens > max_tokens:
            message = f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})"
            raise param_error(type(self).__name__, "min_tokens", message, self.min_tokens)
        return self

    @property
    def max_tokens_requested(self) -> int | None:
        """The cap on generated tokens the client asked for; ``None`` if it gave none."""
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """Top logprobs to return per token; ``None`` returns no logprobs at all."""
        raise NotImplementedError

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token to return; ``None`` (the default): none."""
        return None

    @property
    def stop_list(self) -> list[str]:
        """The stop strings, always as a list (the server matches them, not the engine)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with a chunk carrying ``usage``."""
        return bool(self.stream and self.stream_options is not None
                    and self.stream_options.include_usage)

    @property
    def structured_output_param(self) -> str:
        """The request field a bad constraint is reported against."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured_output(self) -> StructuredOutputParams | None:
        """The output constraint the request asks for (None: free text).

        Raises:
            ValueError: a constraint that is malformed (e.g. ``json`` text that is not JSON).
        """
        if self.structured_outputs is not None:
            return self.structured_outputs.to_params()
        if self.response_format is not None:
            return self.response_format.to_params()
        return None

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """The engine's view of this request (OpenAI → engine conversion, in one place).

        Args:
            default_max_tokens: the cap used when the client set none (the server passes
                the room left in the context window); ``None`` means no cap.

        Raises:
            ValueError: naming the field, when the combination is invalid for the engine
                (e.g. ``min_tokens`` above ``default_max_tokens``).
        """
        max_tokens = self.max_tokens_requested
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,  # vLLM spells "off" as -1
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=(
                {int(token_id): bias for token_id, bias in self.logit_bias.items()}
                if self.logit_bias
                else None
            ),
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_top_logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            structured_output=self.structured_output(),
        )


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


class ChatCompletionRequest(_SamplingRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatCompletionRequestMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    REFUSED_FIELDS: typing.ClassVar[dict[str, Any]] = {
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
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def text_messages(self) -> list[dict[str, str]]:
        """The conversation as ``{"role", "content"}`` dicts (tool calls left out)."""
        return [{"role": message.role, "content": message.text} for message in self.messages]


class CompletionRequest(_SamplingRequest):
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
