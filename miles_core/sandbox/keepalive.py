"""One batched keepalive per manager: re-arms the TTL of every live sandbox, nothing else.

The TTL is the dead-man switch: while the owner lives, a beat every ``ttl/3`` pushes each
sandbox's deadline out again; when the owner dies, beats stop and the provider reclaims the
sandbox. A sandbox leaves the batch *before* it is destroyed, so the keepalive never props up a
sandbox whose destroy failed, and one that reports "not found" (or fails ``max_failures`` beats
in a row) is dropped and left to its TTL. The task ends when the batch is empty.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from miles_core.sandbox.base import SandboxProvider
from miles_core.sandbox.errors import SandboxError, SandboxNotFound
from miles_core.sandbox.secrets import get_logger

log = get_logger(__name__)


@dataclass
class _Entry:
    ttl_s: float
    failures: int = 0


class Keepalive:
    def __init__(
        self, provider: SandboxProvider, *, max_failures: int = 3, min_interval_s: float = 0.05
    ) -> None:
        self.provider = provider
        self.max_failures = max_failures
        self.min_interval_s = min_interval_s
        self._entries: dict[str, _Entry] = {}
        self._task: asyncio.Task[None] | None = None
        self.beats = 0

    def add(self, sandbox_id: str, ttl_s: float) -> None:
        self._entries[sandbox_id] = _Entry(ttl_s)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="miles-sandbox-keepalive")

    def discard(self, sandbox_id: str) -> None:
        self._entries.pop(sandbox_id, None)

    def __contains__(self, sandbox_id: str) -> bool:
        return sandbox_id in self._entries

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _interval(self) -> float:
        return max(self.min_interval_s, min(e.ttl_s for e in self._entries.values()) / 3)

    async def _run(self) -> None:
        while self._entries:
            await asyncio.sleep(self._interval())
            batch = dict(self._entries)
            if not batch:
                break
            results = await asyncio.gather(
                *(self.provider.extend(sid, entry.ttl_s) for sid, entry in batch.items()),
                return_exceptions=True,
            )
            self.beats += 1
            for (sid, entry), result in zip(batch.items(), results):
                self._settle(sid, entry, result)

    def _settle(self, sandbox_id: str, entry: _Entry, result: object) -> None:
        if self._entries.get(sandbox_id) is not entry:
            return  # destroyed (or re-added) while the beat was in flight
        if result is None:
            entry.failures = 0
        elif isinstance(result, SandboxNotFound):
            log.info("keepalive: sandbox %s is gone; dropping it", sandbox_id)
            self.discard(sandbox_id)
        elif isinstance(result, SandboxError):
            entry.failures += 1
            if entry.failures >= self.max_failures:
                log.warning(
                    "keepalive: %d beats failed for %s (%s); leaving it to its TTL",
                    entry.failures,
                    sandbox_id,
                    result,
                )
                self.discard(sandbox_id)
        elif isinstance(result, BaseException):
            raise result

    async def aclose(self) -> None:
        """Stop beating; re-raise what crashed the keepalive task, if anything did."""
        self._entries.clear()
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task})
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
