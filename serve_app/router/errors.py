"""Every error a client can see, in one place: its HTTP status decides its OpenAI ``type`` and
the ``kind`` it is counted under in ``pd_errors_total``; the body is vLLM's ``ErrorResponse``
(``{"error": {"message", "type", "param", "code"}}``, ``code`` being the status), so clients
that handle vLLM's errors handle ours.
"""

from __future__ import annotations

from typing import Any

CLIENT_CLOSED = 499  # nginx's status for a client that went away; used in metrics only

# status -> (OpenAI error type, pd_errors_total kind)
STATUS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("invalid_request_error", "unauthorized"),  # OpenAI's type for a missing or wrong key
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "client_timeout"),
    413: ("invalid_request_error", "too_large"),
    CLIENT_CLOSED: ("client_closed", "client_closed"),
    500: ("internal_error", "internal"),
    502: ("engine_error", "engine"),
    503: ("service_unavailable", "unavailable"),
    504: ("timeout", "timeout"),
}


def error_type(status: int) -> str:
    return STATUS.get(status, ("internal_error", ""))[0]


def error_kind(status: int) -> str:
    return STATUS.get(status, ("", f"http_{status}"))[1]


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    from serve_app.runtime.compat import ErrorInfo, ErrorResponse

    # A message or param can quote the client's own keys, which may hold lone surrogates: JSON
    # can escape them, UTF-8 cannot encode them (the response would fail as it is written).
    info = ErrorInfo(message=_encodable(message), type=error_type(status), param=None if param is None else _encodable(param), code=status)
    return ErrorResponse(error=info).model_dump(mode="json")


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class OpenAIError(Exception):
    """An error the client receives as an OpenAI error body with this status."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)
