"""Limits and scalar types shared by the OpenAI request and response schemas."""

from __future__ import annotations

import math
import uuid
from typing import Annotated, Any

from pydantic import AfterValidator, AllowInfNan, Strict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

#: Most choices (``n``) one request may ask for.
MAX_N = 16
#: Most stop strings one request may give (OpenAI allows 4; we accept more).
MAX_STOP_SEQUENCES = 16
#: Most top logprobs per token a chat request may ask for (``top_logprobs``).
MAX_TOP_LOGPROBS = 20
#: Most top logprobs per token a completions request may ask for (``logprobs``).
MAX_COMPLETION_LOGPROBS = 5
#: Largest absolute ``logit_bias`` value.
MAX_ABS_LOGIT_BIAS = 100.0
#: Most extreme ``seed`` values (OpenAI's int64 range).
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1
#: Logprobs are clamped to this floor so that JSON never carries ``-Infinity``.
MIN_LOGPROB = -9999.0


def _clamp_logprob(value: float) -> float:
    if math.isnan(value) or value < MIN_LOGPROB:
        return MIN_LOGPROB
    return value


#: A JSON integer: strings ("5"), floats (5.0) and booleans are refused, as by OpenAI.
Int = Annotated[int, Strict()]
#: A finite JSON number (an integer is accepted): strings, booleans, NaN and Infinity are not.
Float = Annotated[float, Strict(), AllowInfNan(False)]
#: A log-probability as sent to clients: finite, at least ``MIN_LOGPROB``.
LogProb = Annotated[float, AfterValidator(_clamp_logprob)]


def random_id(prefix: str) -> str:
    """A fresh response id such as ``chatcmpl-3f2a...`` (``prefix`` without the dash)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def param_error(model_name: str, param: str, message: str, value: Any) -> ValidationError:
    """A ``ValidationError`` located at ``param``, for checks that span several fields.

    Raised inside a model validator, pydantic keeps its location (prefixed by the
    enclosing path), so ``validation_error_to_body`` can name the parameter.
    """
    error = InitErrorDetails(
        type=PydanticCustomError("value_error", message), loc=(param,), input=value
    )
    return ValidationError.from_exception_data(model_name, [error])
