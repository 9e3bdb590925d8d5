"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every refusal."""

from __future__ import annotations


class ApiError(Exception):
    """A request the service refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_found(what: str, ident: str, param: str) -> ApiError:
    return ApiError(404, f"No {what} with id {ident!r} found", param=param, code=None)
