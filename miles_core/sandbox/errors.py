"""The sandbox error taxonomy. Providers map their SDK's exceptions onto these *by type*.

The lifecycle layer retries :attr:`SandboxError.retryable` errors with jittered backoff
(honouring :attr:`SandboxThrottled.retry_after`) and surfaces the rest at once. Every message is
passed through :func:`~miles_core.sandbox.secrets.redact` when the error is built.
"""

from __future__ import annotations

from miles_core.errors import MilesError
from miles_core.sandbox.secrets import redact


class SandboxError(MilesError):
    """Base of every sandbox failure. ``provider`` names the provider that raised it."""

    retryable = False

    def __init__(self, message: str, *, provider: str | None = None) -> None:
        self.provider = provider
        prefix = f"sandbox provider {provider!r}: " if provider else ""
        super().__init__(redact(prefix + message))


class SandboxThrottled(SandboxError):
    """The provider rate-limited the call (HTTP 429 or its SDK's equivalent)."""

    retryable = True

    def __init__(
        self, message: str, *, provider: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, provider=provider)
        self.retry_after = retry_after


class SandboxCapacityError(SandboxError):
    """No capacity to place a sandbox right now (quota, HTTP 503, host full)."""

    retryable = True


class SandboxTransientError(SandboxError):
    """A network or server hiccup: the same call may succeed if repeated."""

    retryable = True


class SandboxFatalError(SandboxError):
    """Retrying cannot help: bad credentials, invalid arguments, a failed image build."""


class SandboxNotFound(SandboxFatalError):
    """The sandbox does not exist any more (destroyed, or its TTL expired)."""


class SandboxUnsupported(SandboxFatalError):
    """The provider lacks the capability the call needs (see ``provider.capabilities``)."""


class ImageBuildError(SandboxFatalError):
    """An image recipe failed; the message names the step."""
