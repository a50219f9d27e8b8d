"""OpenAI's error JSON and the status codes that go with each kind of failure.

Body: ``{"error": {"message", "type", "param", "code"}}``, as the official client
parses it (``openai.BadRequestError`` for 400, ``NotFoundError`` for 404, ...).
"""
from __future__ import annotations

import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable_error"}
_ENGINE_FIELD = re.compile(r"SamplingParams\.(\w+)")


class OpenAIError(Exception):
    """A request failure with its HTTP status and, when one field is to blame, that field's name."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "internal_server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(error: ValueError) -> OpenAIError:
    """A ``ValueError`` whose message starts with the field (``"prompt: ..."``) as a 400 naming it."""
    message = str(error)
    field, _, _ = message.partition(":")
    return OpenAIError(400, message, field if field.isidentifier() else None)


def engine_rejection(message: str) -> OpenAIError:
    """Triton's INVALID_ARG from the backend: the engine names the sampling parameter it refused."""
    match = _ENGINE_FIELD.search(message)
    return OpenAIError(400, message, match.group(1) if match else None)


def validation_error(error: RequestValidationError) -> OpenAIError:
    """pydantic's first complaint about the body, with the dotted path of the field as ``param``."""
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    return OpenAIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)
