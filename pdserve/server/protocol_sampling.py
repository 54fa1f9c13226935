"""Fields, validation and engine conversion shared by the chat and text completion requests.

NOTE: :meth:`SamplingRequest.to_sampling_params` is the one place where an API request
becomes the engine's ``SamplingParams``. Everything the engine does not see (stop strings,
streaming, the prompt itself) stays on the request and is read by the server.

Validation follows the OpenAI API: a wrong type or out-of-range value raises a pydantic
``ValidationError`` whose location names the parameter (``temperature``). Unknown fields
are accepted and ignored, and ``null`` means "use the default" for every field whose type
has no ``None`` of its own.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

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
    MAX_N,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    MIN_SEED,
    Float,
    Int,
    param_error,
)
from pdserve.server.protocol_structured import ResponseFormat, StructuredOutputsOptions


def _admits_none(annotation: Any) -> bool:
    """True when ``None`` is a valid value of the field type ``annotation``."""
    if annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits_none(arg) for arg in typing.get_args(annotation))
    return False


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk carrying ``usage``."""

    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = None  # null: the default (no usage chunk)

    @model_validator(mode="before")
    @classmethod
    def _refuse_continuous_usage(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("continuous_usage_stats"):
            raise ValueError("continuous_usage_stats is not supported by this server")
        return data


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


#: vLLM request extensions that would change the output and that this server does not
#: implement: refused by name rather than ignored (field -> predicate true for a harmless
#: value, None: any non-null value is refused).
VLLM_REFUSED_FIELDS: dict[str, Any] = {
    "use_beam_search": lambda value: value is False,
    "length_penalty": lambda value: value == 1.0,
    "bad_words": lambda value: value == [],
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "skip_special_tokens": lambda value: value is True,
    "spaces_between_special_tokens": lambda value: value is True,
    "logits_processors": None,
    "return_tokens_as_token_ids": lambda value: value is False,
    "guided_whitespace_pattern": None,
}


class SamplingRequest(BaseModel):
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
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(
        None, description="extension")
    include_stop_str_in_output: StrictBool = Field(False, description="extension")
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
        _refuse_fields(data, {**VLLM_REFUSED_FIELDS, **cls.REFUSED_FIELDS})
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
    def _one_structured_output(self) -> SamplingRequest:
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            message = "response_format and structured_outputs cannot both constrain the output"
            raise param_error(type(self).__name__, "structured_outputs", message, None)
        return self

    @model_validator(mode="after")
    def _check_min_tokens(self) -> SamplingRequest:
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
            stop_token_ids=list(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.num_top_logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            structured_output=self.structured_output(),
        )
