"""Errors the session server answers with: each has an HTTP status and an OpenAI-style type.

Messages are bounded (:data:`MAX_MESSAGE_CHARS`) so no error body grows with a session's history.
"""

from __future__ import annotations

MAX_MESSAGE_CHARS = 1024


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more chars)"


class SessionError(Exception):
    """Base class; ``status`` and ``type`` form the JSON error reply."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(bounded(message))

    @property
    def message(self) -> str:
        return str(self)

    def to_dict(self) -> dict[str, dict[str, str]]:
        return {"error": {"type": self.type, "message": self.message}}


class InvalidRequest(SessionError):
    """The request is malformed or not allowed (nothing was changed)."""

    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(SessionError):
    status = 413
    type = "request_too_large_error"


class SessionNotFound(SessionError):
    status = 404
    type = "not_found_error"


class RouteNotFound(SessionError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(SessionError):
    status = 405
    type = "method_not_allowed_error"


class Misdirected(SessionError):
    """The session lives in another worker of this server, and this request could not be moved
    there (``miles session serve --workers``): send it again on another connection."""

    status = 421
    type = "misdirected_request_error"


class Conflict(SessionError):
    """The request is valid but conflicts with the session's state (busy, closing, truncated)."""

    status = 409
    type = "conflict_error"


class Unprocessable(SessionError):
    """Well-formed, but the token state it would produce is inconsistent."""

    status = 422
    type = "unprocessable_error"


class UpstreamFailure(SessionError):
    """The inference engine failed or answered outside its contract (nothing was recorded)."""

    status = 502
    type = "upstream_error"
