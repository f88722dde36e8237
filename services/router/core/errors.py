"""The error a client gets back: an HTTP status and an OpenAI-style error body."""

from __future__ import annotations


class APIError(Exception):
    """A request that cannot be served; `status` is the HTTP status to answer with."""

    def __init__(
        self,
        message: str,
        status: int = 503,
        type_: str = "server_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.headers = headers  # of the response, e.g. Retry-After on a 429
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(str(self), self.type, self.param, self.code)


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
