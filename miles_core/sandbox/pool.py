"""Warm sandboxes for many short commands: what rewards that execute model output use.

:class:`SandboxPool` keeps ``size`` sandboxes created ahead of demand, so an RL step pays for
an exec, not for a create. Each ``exec`` takes a warm sandbox, writes the call's files, runs the
command and hands the sandbox back -- or, once it has served ``max_uses`` calls (default 1:
every sample gets a fresh sandbox, nothing leaks between samples) or timed out or failed,
destroys it and creates a replacement in the background. A replacement that cannot be created
is reported to the next caller, and the pool keeps trying.

:class:`SyncSandboxPool` is the same for code without an event loop: it runs the pool on a
background thread and blocks on each call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from miles_core.sandbox.activation import DEFAULT_PROVIDER, open_provider
from miles_core.sandbox.base import Command, ExecResult, SandboxProvider, SandboxSpec
from miles_core.sandbox.lifecycle import Sandbox, SandboxManager

T = TypeVar("T")


class SandboxPool:
    """``size`` warm sandboxes of ``spec`` on ``provider``.

    ``async with SandboxPool(provider, spec, size) as pool: await pool.exec(...)``. The pool owns
    its :class:`SandboxManager` (pass ``manager_options`` for limits/retries); it closes the
    provider only if it opened it (:meth:`open`).
    """

    def __init__(
        self,
        provider: SandboxProvider,
        spec: SandboxSpec | None = None,
        size: int = 8,
        *,
        max_uses: int = 1,
        owns_provider: bool = False,
        **manager_options: Any,
    ) -> None:
        if size < 1 or max_uses < 1:
            raise ValueError("SandboxPool needs size >= 1 and max_uses >= 1")
        self.spec = spec or SandboxSpec()
        self.size = size
        self.max_uses = max_uses
        self.manager = SandboxManager(provider, **manager_options)
        self._owns_provider = owns_provider
        self._ready: asyncio.Queue[Sandbox | BaseException] = asyncio.Queue()
        self._uses: dict[str, int] = {}
        self._refills: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    def open(
        cls,
        provider: str = DEFAULT_PROVIDER,
        spec: SandboxSpec | None = None,
        size: int = 8,
        *,
        config: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> SandboxPool:
        """A pool over a freshly activated provider (verified, fail closed), closed with the pool."""
        return cls(open_provider(provider, config), spec, size, owns_provider=True, **options)

    async def start(self) -> SandboxPool:
        """Create the warm sandboxes (returns once the first creates were started)."""
        for _ in range(self.size):
            self._refill()
        return self

    def _refill(self) -> None:
        task = asyncio.get_running_loop().create_task(self._create_one())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def _create_one(self) -> None:
        try:
            sandbox = await self.manager.create(self.spec)
        except Exception as exc:
            self._ready.put_nowait(exc)
            return
        self._uses[sandbox.id] = 0
        self._ready.put_nowait(sandbox)

    async def _acquire(self) -> Sandbox:
        item = await self._ready.get()
        if isinstance(item, BaseException):
            self._refill()  # keep trying for the next caller
            raise item
        return item

    async def _release(self, sandbox: Sandbox, *, recycle: bool) -> None:
        uses = self._uses.get(sandbox.id, 0) + 1
        if self._closed or recycle or uses >= self.max_uses:
            self._uses.pop(sandbox.id, None)
            if not self._closed:
                self._refill()
            await self.manager.destroy(sandbox)
        else:
            self._uses[sandbox.id] = uses
            self._ready.put_nowait(sandbox)

    async def exec(
        self,
        cmd: Command,
        *,
        files: Mapping[str, bytes | str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run ``cmd`` in a warm sandbox after writing ``files`` (paths relative to its workdir)."""
        if self._closed:
            raise RuntimeError("the sandbox pool is closed")
        sandbox = await self._acquire()
        result: ExecResult | None = None
        try:
            for path, data in (files or {}).items():
                await sandbox.write_file(path, data)
            result = await sandbox.exec(cmd, env=env, cwd=cwd, timeout=timeout)
            return result
        finally:
            recycle = result is None or result.timed_out
            await asyncio.shield(self._release(sandbox, recycle=recycle))

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._refills):
            task.cancel()
        await asyncio.gather(*self._refills, return_exceptions=True)
        try:
            await self.manager.aclose()
        finally:
            if self._owns_provider:
                await self.manager.provider.aclose()

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class SyncSandboxPool:
    """A :class:`SandboxPool` for synchronous callers, run on a private event-loop thread.

    ``with SyncSandboxPool("local", spec, size=8) as pool: result = pool.exec("python3 a.py",
    files={"a.py": code}, timeout=10)``. Calls are thread-safe and may overlap.
    """

    def __init__(
        self,
        provider: str = DEFAULT_PROVIDER,
        spec: SandboxSpec | None = None,
        size: int = 8,
        *,
        config: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="miles-sandbox-pool", daemon=True)
        self._thread.start()
        try:
            self._pool: SandboxPool = self._call(self._open(provider, spec, size, config, options))
        except BaseException:
            self._stop()
            raise

    async def _open(
        self, provider: str, spec: SandboxSpec | None, size: int, config: Any, options: Any
    ) -> SandboxPool:
        return await SandboxPool.open(provider, spec, size, config=config, **options).start()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def exec(
        self,
        cmd: Command,
        *,
        files: Mapping[str, bytes | str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        return self._call(self._pool.exec(cmd, files=files, env=env, cwd=cwd, timeout=timeout))

    def close(self) -> None:
        try:
            self._call(self._pool.aclose())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncSandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
