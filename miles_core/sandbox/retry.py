"""Jittered exponential backoff for retryable sandbox errors."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from miles_core.errors import ConfigError
from miles_core.sandbox.errors import SandboxError, SandboxThrottled
from miles_core.sandbox.secrets import get_logger

T = TypeVar("T")
log = get_logger(__name__)
#: the jitter source of callers that pass no ``rng``
_JITTER = random.Random()


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` calls at most; before attempt ``n+1`` wait ``d/2 + U(0, d/2)`` with
    ``d = min(cap_s, base_s * 2**n)`` -- or the provider's ``retry_after`` when it gave one."""

    attempts: int = 6
    base_s: float = 0.5
    cap_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.cap_s < self.base_s:
            raise ConfigError(f"RetryPolicy needs attempts >= 1 and 0 <= base_s <= cap_s, got {self}")

    def delay(self, attempt: int, error: BaseException, rng: random.Random | None = None) -> float:
        rng = rng if rng is not None else _JITTER
        if isinstance(error, SandboxThrottled) and error.retry_after is not None:
            return min(self.cap_s, error.retry_after) * (1.0 + 0.25 * rng.random())
        ceiling = min(self.cap_s, self.base_s * 2**attempt)
        return ceiling / 2 + rng.uniform(0, ceiling / 2)


async def retrying(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    what: str,
    rng: random.Random | None = None,
) -> T:
    """Await ``call()`` until it succeeds, raises a non-retryable error or runs out of attempts."""
    attempt = 0
    while True:
        try:
            return await call()
        except SandboxError as exc:
            if not exc.retryable or attempt + 1 >= policy.attempts:
                raise
            pause = policy.delay(attempt, exc, rng)
            log.info(
                "%s: %s; retry %d/%d in %.2fs",
                what,
                type(exc).__name__,
                attempt + 1,
                policy.attempts - 1,
                pause,
            )
            attempt += 1
            await asyncio.sleep(pause)


DEFAULT_RETRY = RetryPolicy()
