"""API errors and their two wire shapes.

Every failure a client can see is an `ApiError`: a status code, a message meant for the client, and the error
type/code the API family uses. Routes under /v1/messages answer in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`), everything else in OpenAI's (`{"error": {"message", "type",
"param", "code"}}`), so each official client parses our errors as it parses its own vendor's.
"""

from __future__ import annotations

import json
from typing import Any

OPENAI = "openai"
ANTHROPIC = "anthropic"

# Anthropic names its error types by status; these are the ones its API documents.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                 404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An error answered to the client as JSON. `message` must be safe to show (no internals)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def style_for_path(path: str) -> str:
    """Which API family's error shape a request path gets."""
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def error_body(err: ApiError, style: str) -> dict[str, Any]:
    """The JSON error object in `style`."""
    if style == ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    kind = _OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def error_bytes(err: ApiError, style: str) -> bytes:
    return json.dumps(error_body(err, style)).encode()
