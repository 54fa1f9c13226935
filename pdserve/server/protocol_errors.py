"""OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

#: ``type`` of an error caused by the request (HTTP 4xx).
INVALID_REQUEST_ERROR = "invalid_request_error"


class ErrorInfo(BaseModel):
    """What went wrong; ``param`` names the offending request parameter, if one did."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Body of every non-2xx response."""

    error: ErrorInfo


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The JSON-ready OpenAI error body."""
    info = ErrorInfo(message=message, type=type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()


#: Union members pydantic names in an error's location, which are no request field.
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})


def _is_union_member(part: int | str) -> bool:
    """``literal['none','auto']``, ``list[str]``, ``function-after[...]``, ``NamedToolChoice``:
    the union branch pydantic tried, not a field (fields are snake_case, indices ints)."""
    if isinstance(part, int):
        return False
    return (part in _TYPE_NAMES or any(c in part for c in "[('") or part[:1].isupper())


def _loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    # FastAPI's RequestValidationError prefixes body errors with "body".
    if loc and loc[0] == "body":
        loc = loc[1:]
    return ".".join(str(part) for part in loc if not _is_union_member(part)) or None


def _message(error: dict[str, Any]) -> str:
    # Errors raised as ValueError in a validator read "Value error, <text>"; keep <text>.
    cause = error.get("ctx", {}).get("error")
    return str(cause) if error["type"] == "value_error" and cause is not None else error["msg"]


def validation_error_to_body(exc: Any) -> dict[str, Any]:
    """A 400 error body for a failed request validation, naming its first offending parameter.

    Args:
        exc: a ``pydantic.ValidationError`` (or FastAPI's ``RequestValidationError``; any
            object whose ``errors()`` lists pydantic error dicts).

    Returns:
        ``{"error": {"message", "type": "invalid_request_error", "param", "code": None}}``
        where ``param`` is the dotted location (``"messages.0.role"``), or ``None`` when the
        body as a whole is wrong (not JSON, not an object).
    """
    errors = exc.errors()
    if not errors:
        return error_body(str(exc), INVALID_REQUEST_ERROR)
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    message = _message(first)
    if param is not None and first["type"] == "missing":
        message = f"Missing required parameter: '{param}'"
    elif param is not None:
        message = f"Invalid value for '{param}': {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return error_body(message, INVALID_REQUEST_ERROR, param=param)
