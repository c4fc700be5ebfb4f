"""SDK exceptions map onto the sandbox error taxonomy by type -- never by message text."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import e2b
import httpx
import pytest
from miles_e2b.fake import FakeE2BServer
from miles_e2b.provider import E2BProvider
from miles_e2b.sdk import to_sandbox_error

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.errors import (
    ImageBuildError,
    SandboxCapacityError,
    SandboxError,
    SandboxFatalError,
    SandboxNotFound,
    SandboxThrottled,
    SandboxTransientError,
)
from miles_core.sandbox.lifecycle import SandboxManager
from miles_core.sandbox.retry import RetryPolicy

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (e2b.RateLimitException("429: Rate limit exceeded"), SandboxThrottled),
        (e2b.ServiceBusyException("503: Service temporarily unavailable"), SandboxCapacityError),
        (e2b.AuthenticationException("401: Unauthorized"), SandboxFatalError),
        (e2b.InvalidArgumentException("bad timeout"), SandboxFatalError),
        (e2b.BuildException("step 3 failed"), ImageBuildError),
        (e2b.SandboxNotFoundException("Sandbox x not found"), SandboxNotFound),
        (e2b.SandboxNotRunningException("x was not found"), SandboxNotFound),
        (e2b.SandboxUnreachableException("port is not open"), SandboxTransientError),
        (e2b.TimeoutException("request timed out"), SandboxTransientError),
        (httpx.ConnectError("connection refused"), SandboxTransientError),
        (e2b.SandboxException("502: bad gateway", status_code=502), SandboxTransientError),
        (e2b.FileNotFoundException("no such file"), SandboxFatalError),
        # "429" in the text of a client error is not throttling
        (e2b.SandboxException("400: template name 'a429' invalid", status_code=400), SandboxFatalError),
        (RuntimeError("rate limit exceeded (429)"), SandboxFatalError),
    ],
)
def test_mapping_is_by_type(exc: BaseException, expected: type[SandboxError]) -> None:
    mapped = to_sandbox_error(exc, e2b, "create")
    assert type(mapped) is expected, mapped
    assert mapped.provider == "e2b" and type(exc).__name__ in str(mapped)


def test_throttled_creates_are_retried_by_the_lifecycle_layer(
    server: FakeE2BServer, make_provider: Callable[..., E2BProvider]
) -> None:
    server.fail_next = [e2b.RateLimitException("429"), e2b.ServiceBusyException("503")]

    async def main() -> None:
        provider = make_provider()
        async with SandboxManager(
            provider, retry=RetryPolicy(attempts=3, base_s=0.001, cap_s=0.002)
        ) as manager:
            box = await manager.create()
            assert box.id in server.sandboxes
        creates = [c for c in server.calls if c[0] == "AsyncSandbox.create"]
        assert len(creates) == 3
        # one logical create: every retry carries the same idempotency key
        assert len({c[2]["idempotency_key"] for c in creates}) == 1
        server.fail_next = [e2b.AuthenticationException("401")]
        async with SandboxManager(
            provider, retry=RetryPolicy(attempts=3, base_s=0.001, cap_s=0.002)
        ) as manager:
            with pytest.raises(SandboxFatalError):
                await manager.create()
        assert len([c for c in server.calls if c[0] == "AsyncSandbox.create"]) == 4

    asyncio.run(main())
