"""What the engine client raises when the engine cannot be reached or breaks the contract.

Apart from :mod:`miles_core.engine.client` (which re-exports them) so that code handling these
errors -- the session service's upstreams -- does not import the HTTP client and httpx with it.
"""

from __future__ import annotations

from miles_core.errors import MilesError


class EngineError(MilesError):
    """Base class: the engine could not be reached or did not answer as the contract says."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(f"{message} ({url})")
        self.detail = message
        self.url = url


class EngineConnectionError(EngineError):
    """No connection could be made, or the connection broke before a complete reply."""


class EngineTimeoutError(EngineError):
    """The engine did not answer within the configured timeout."""


class EngineHTTPError(EngineError):
    """The engine answered with a non-2xx status; ``body_snippet`` is the start of its body."""

    def __init__(self, status_code: int, body_snippet: str, *, url: str) -> None:
        super().__init__(f"engine answered HTTP {status_code}: {body_snippet}", url=url)
        self.status_code = status_code
        self.body_snippet = body_snippet


class EngineProtocolError(EngineError):
    """The engine answered 2xx with a body that is not the JSON object the contract promises."""
