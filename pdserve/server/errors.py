"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pdserve.server.protocol import error_body

#: HTTP status -> OpenAI error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers; turned into an OpenAI error body with ``status``.

    Args:
        status: HTTP status code.
        message: user-facing explanation.
        param: the offending request parameter, if any.
        code: a short machine-readable code, if any.
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        """The error as an OpenAI error body with this status; a 503 adds
        ``Retry-After: 1``."""
        headers = {"Retry-After": "1"} if self.status == 503 else None
        body = error_body(self.message, ERROR_TYPES.get(self.status, "invalid_request_error"),
                          self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=headers)
