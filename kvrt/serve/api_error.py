"""The OpenAI-shaped HTTP error every part of the HTTP front raises (bodies, grammars, tools, routes)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status`` and the ``{"error": {...}}`` body's fields."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
