"""The lifecycle layer every provider shares: :class:`SandboxManager` and its :class:`Sandbox`.

What it guarantees, whatever the provider:

* **Ownership.** Every sandbox carries the owner labels of :mod:`~miles_core.sandbox.ownership`.
* **Cancellation-safe create.** The provider's create runs in its own task, awaited through
  ``asyncio.shield``. If the caller is cancelled, the create still runs to its end; a sandbox it
  produces anyway is destroyed, and the concurrency slot stays held until both have finished, so
  ``max_concurrent_creates`` bounds real provider creates at every instant.
* **Retries.** Throttled / capacity / transient errors are retried with jittered backoff; the
  slot is released while backing off. One logical create keeps one ``miles.create`` label across
  retries (providers with idempotent create use it as the idempotency key).
* **Keepalive + TTL.** One batched :class:`~miles_core.sandbox.keepalive.Keepalive` per manager;
  a sandbox leaves it before it is destroyed.
* **Single-flight images.** Concurrent ``prepare_image`` calls for one recipe digest share one
  build; a finished build is memoized, a failed one is retried on the next call.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from miles_core.sandbox.base import (
    LABEL_CREATE,
    Command,
    Endpoint,
    ExecResult,
    ImageRef,
    ImageSpec,
    SandboxProvider,
    SandboxRef,
    SandboxSpec,
)
from miles_core.sandbox.keepalive import Keepalive
from miles_core.sandbox.ownership import Owner, SweepReport, sweep
from miles_core.sandbox.retry import DEFAULT_RETRY, RetryPolicy, retrying
from miles_core.sandbox.secrets import get_logger

log = get_logger(__name__)


class Sandbox:
    """A live sandbox owned by a :class:`SandboxManager`. ``async with`` destroys it on exit."""

    def __init__(self, manager: SandboxManager, ref: SandboxRef, spec: SandboxSpec) -> None:
        self.manager = manager
        self.ref = ref
        self.spec = spec

    @property
    def id(self) -> str:
        return self.ref.id

    @property
    def labels(self) -> Mapping[str, str]:
        return self.ref.labels

    def __repr__(self) -> str:
        return f"Sandbox({self.ref.provider}:{self.ref.id})"

    async def exec(
        self,
        cmd: Command,
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        background: bool = False,
    ) -> ExecResult:
        """Run ``cmd`` (never retried: a command may have side effects)."""
        return await self.manager.provider.exec(
            self.ref, cmd, user=user, env=env, cwd=cwd, timeout=timeout, background=background
        )

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        provider = self.manager.provider
        await self.manager._retry(lambda: provider.write_file(self.ref, path, data, mode=mode), "write_file")

    async def read_file(self, path: str) -> bytes:
        provider = self.manager.provider
        return await self.manager._retry(lambda: provider.read_file(self.ref, path), "read_file")

    async def expose(self, port: int) -> Endpoint:
        return await self.manager.provider.expose(self.ref, port)

    async def extend(self, ttl_s: float) -> None:
        """Push the deadline to ``ttl_s`` from now (and keep beating at that TTL)."""
        provider = self.manager.provider
        await self.manager._retry(lambda: provider.extend(self.id, ttl_s), "extend")
        if self.id in self.manager.keepalive:
            self.manager.keepalive.add(self.id, ttl_s)

    async def destroy(self) -> None:
        await self.manager.destroy(self)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()


class SandboxManager:
    """Creates, tracks and destroys the sandboxes of one owner on one provider.

    Use as ``async with SandboxManager(provider) as manager``; leaving destroys every sandbox it
    still holds and waits for background reaping. The manager does not close the provider.
    """

    def __init__(
        self,
        provider: SandboxProvider,
        *,
        owner: Owner | None = None,
        max_concurrent_creates: int = 8,
        retry: RetryPolicy = DEFAULT_RETRY,
        keepalive: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        if max_concurrent_creates < 1:
            raise ValueError("max_concurrent_creates must be >= 1")
        self.provider = provider
        self.owner = owner or Owner.current()
        self.max_concurrent_creates = max_concurrent_creates
        self.retry = retry
        self.rng = rng or random.Random()
        self.keepalive = Keepalive(provider)
        self._keepalive_enabled = keepalive and provider.capabilities.ttl == "rearmable"
        self._slots = asyncio.Semaphore(max_concurrent_creates)
        self._live: dict[str, Sandbox] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._images: dict[str, asyncio.Task[ImageRef]] = {}

    # -- images ---------------------------------------------------------------------------

    async def prepare_image(self, spec: ImageSpec) -> ImageRef:
        """The provider's image for ``spec``, built at most once at a time per digest."""
        task = self._images.get(spec.digest)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.get_running_loop().create_task(
                self._retry(lambda: self.provider.prepare_image(spec), f"prepare_image {spec.name}")
            )
            self._images[spec.digest] = task
        return await asyncio.shield(task)

    # -- create / destroy -----------------------------------------------------------------

    async def create(self, spec: SandboxSpec | None = None) -> Sandbox:
        """A new sandbox labelled with this manager's owner (see the module docstring)."""
        spec = spec or SandboxSpec()
        labels = {**spec.labels, **self.owner.labels(), LABEL_CREATE: uuid.uuid4().hex}
        spec = replace(spec, labels=labels)
        attempt = 0
        while True:
            await self._slots.acquire()
            task = asyncio.get_running_loop().create_task(self.provider.create(spec))
            try:
                ref = await asyncio.shield(task)
            except asyncio.CancelledError:
                self._track(asyncio.get_running_loop().create_task(self._reap_late(task)))
                raise
            except BaseException as exc:
                self._slots.release()
                retryable = getattr(exc, "retryable", False)
                if not retryable or attempt + 1 >= self.retry.attempts:
                    raise
                pause = self.retry.delay(attempt, exc, self.rng)
                log.info("create: %s; retry %d in %.2fs", type(exc).__name__, attempt + 1, pause)
                attempt += 1
                await asyncio.sleep(pause)
                continue
            self._slots.release()
            return self._adopt(ref, spec)

    def _adopt(self, ref: SandboxRef, spec: SandboxSpec) -> Sandbox:
        # no await between the provider's answer and registration: a cancellation cannot land
        # between them, so every sandbox the provider returned is either adopted or reaped
        sandbox = Sandbox(self, ref, spec)
        self._live[ref.id] = sandbox
        if self._keepalive_enabled:
            self.keepalive.add(ref.id, spec.ttl_s)
        return sandbox

    async def _reap_late(self, create: asyncio.Task[SandboxRef]) -> None:
        """Wait for a create whose caller left; destroy what it made; then free the slot."""
        try:
            await asyncio.wait({create})
            if create.cancelled() or create.exception() is not None:
                return
            ref = create.result()
            log.info("create of %s finished after its caller was cancelled; destroying it", ref.id)
            await self._retry(lambda: self.provider.destroy(ref.id), f"destroy late {ref.id}")
        finally:
            self._slots.release()

    async def destroy(self, sandbox: Sandbox | str) -> None:
        """Destroy a sandbox (idempotent). Runs to completion even if the caller is cancelled."""
        sandbox_id = sandbox if isinstance(sandbox, str) else sandbox.id
        self.keepalive.discard(sandbox_id)
        self._live.pop(sandbox_id, None)
        task = self._track(
            asyncio.get_running_loop().create_task(
                self._retry(lambda: self.provider.destroy(sandbox_id), f"destroy {sandbox_id}")
            )
        )
        await asyncio.shield(task)

    # -- bookkeeping ------------------------------------------------------------------------

    @property
    def live(self) -> list[Sandbox]:
        return list(self._live.values())

    def _track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _retry(self, call: Any, what: str) -> Any:
        return await retrying(call, self.retry, what=f"{self.provider.name} {what}", rng=self.rng)

    async def drain(self) -> None:
        """Wait until every background destroy/reap has finished; re-raise the first failure."""
        while self._background:
            done, _ = await asyncio.wait(set(self._background))
            for task in done:
                error = None if task.cancelled() else task.exception()
                if error is not None:
                    raise error

    async def sweep(self, *, owner: str | None = None, dry_run: bool = False) -> SweepReport:
        """Destroy this provider's orphans (see :func:`miles_core.sandbox.ownership.sweep`)."""
        return await sweep(self.provider, owner=owner, dry_run=dry_run, retry=self.retry)

    async def aclose(self) -> None:
        """Destroy every sandbox still held, stop the keepalive, wait for background work."""
        await self.keepalive.aclose()
        results = await asyncio.gather(*(self.destroy(s) for s in self.live), return_exceptions=True)
        await self.drain()
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def __aenter__(self) -> SandboxManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
