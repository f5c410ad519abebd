"""Errors of the OpenAI surface: :class:`OpenAIError` and its JSON body."""

from __future__ import annotations

import msgspec


class OpenAIError(Exception):
    """A request the server answers with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.kind, self.param)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": kind, "param": param,
                                          "code": status}})


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)
