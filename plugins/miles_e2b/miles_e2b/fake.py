"""An in-process fake of the E2B SDK objects miles-e2b uses, for tests without network.

``FakeE2B(server)`` stands in for the ``e2b`` module (pass it as ``E2BProvider(..., sdk=...)``):
``AsyncSandbox``, ``AsyncTemplate``, ``SandboxQuery`` and the SDK's real exception classes. The
:class:`FakeE2BServer` behind it behaves like the service where the provider can tell:

* a sandbox is a directory; commands really run there (``/bin/bash -c``, so the provider's
  ``ulimit`` line is enforced), background ones included, and die when it is killed;
* creates take ``create_latency_s`` and the sandbox exists half-way through -- a client that
  stops waiting in the second half leaks it, like a lost HTTP response; idempotency keys are
  honoured; ``fail_next`` scripts errors;
* TTLs (``timeout``/``set_timeout``) expire on the wall clock; metadata filters listing;
* templates are built by running their instructions; ``exists`` reports built names;
* every call is checked against the configured key and recorded as
  ``(name, args, kwargs)`` in ``server.calls`` (names as in :data:`miles_e2b.sdk.SDK_CALLS`),
  so tests can bind each one to the installed SDK's real signature.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import e2b
from e2b.sandbox.sandbox_api import SandboxInfo as _SdkSandboxInfo

from miles_e2b import sdk as surface

POLL_S = 0.005


def recorded(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Record each call as made (arguments after ``self``/``cls``) on the owner's server."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(owner: Any, *args: Any, **kwargs: Any) -> Any:
                owner.server.calls.append((name, args, kwargs))
                return await fn(owner, *args, **kwargs)

            return run_async

        @functools.wraps(fn)
        def run(owner: Any, *args: Any, **kwargs: Any) -> Any:
            owner.server.calls.append((name, args, kwargs))
            return fn(owner, *args, **kwargs)

        return run

    return decorate


@dataclass
class _State:
    id: str
    root: Path
    workdir: str
    metadata: dict[str, str]
    envs: dict[str, str]
    expires_at: float
    domain: str
    allow_internet_access: bool | None
    traffic_token: str | None
    template: str | None
    procs: set[subprocess.Popen[bytes]] = field(default_factory=set)

    def host_path(self, path: str) -> Path:
        full = path if path.startswith("/") else f"{self.workdir}/{path}"
        return self.root / full.lstrip("/")


class FakeE2BServer:
    def __init__(self, *, api_key: str, create_latency_s: float = 0.0, workdir: str = "/home/user") -> None:
        self.api_key = api_key
        self.create_latency_s = create_latency_s
        self.workdir = workdir
        self.root = Path(tempfile.mkdtemp(prefix="fake-e2b-"))
        self.sandboxes: dict[str, _State] = {}
        self.templates: dict[str, Path] = {}
        self.idempotency: dict[str, str] = {}
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.fail_next: list[BaseException] = []
        self.echo_key_in_auth_errors = False
        self.in_flight_creates = 0
        self.max_in_flight_creates = 0
        self.builds: list[str] = []

    def check(self, opts: dict[str, Any]) -> None:
        key = opts.get("api_key")
        if key != self.api_key:
            detail = f" (got key {key})" if self.echo_key_in_auth_errors else ""
            raise e2b.AuthenticationException(f"401: Unauthorized, please check your credentials.{detail}")

    def live(self, sandbox_id: str) -> _State | None:
        self.expire()
        return self.sandboxes.get(sandbox_id)

    def expire(self) -> None:
        now = time.monotonic()
        for state in [s for s in self.sandboxes.values() if s.expires_at <= now]:
            self.remove(state)

    def remove(self, state: _State) -> None:
        self.sandboxes.pop(state.id, None)
        for proc in state.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(state.root, ignore_errors=True)

    def close(self) -> None:
        for state in list(self.sandboxes.values()):
            self.remove(state)
        shutil.rmtree(self.root, ignore_errors=True)


class FakeE2B:
    """Stands in for the ``e2b`` module, bound to one :class:`FakeE2BServer`."""

    def __init__(self, server: FakeE2BServer) -> None:
        self.server = server
        self.AsyncSandbox = type("AsyncSandbox", (_FakeSandbox,), {"server": server})
        self.AsyncTemplate = type("AsyncTemplate", (_FakeTemplate,), {"server": server})
        self.SandboxQuery = e2b.SandboxQuery
        for name in surface.EXCEPTIONS:
            setattr(self, name, getattr(e2b, name))


class _FakeHandle:
    """A command started with ``subprocess`` and polled: the fake server outlives event loops,
    so it holds no loop-bound transports."""

    def __init__(
        self, server: FakeE2BServer, proc: subprocess.Popen[bytes], timeout: float | None, output: Path
    ) -> None:
        self.server = server
        self.proc = proc
        self.pid = proc.pid
        self.timeout = timeout or None
        self.output = output

    @recorded("AsyncCommandHandle.wait")
    async def wait(self) -> Any:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while self.proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                await self.kill()
                raise e2b.TimeoutException("deadline_exceeded: command timed out")
            await asyncio.sleep(POLL_S)
        stdout = (self.output / "stdout").read_bytes().decode(errors="replace")
        stderr = (self.output / "stderr").read_bytes().decode(errors="replace")
        if self.proc.returncode != 0:
            raise e2b.CommandExitException(
                stderr=stderr, stdout=stdout, exit_code=self.proc.returncode, error=None
            )
        return e2b.CommandResult(stderr=stderr, stdout=stdout, exit_code=0, error=None)

    @recorded("AsyncCommandHandle.kill")
    async def kill(self) -> bool:
        if self.proc.poll() is not None:
            return False
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return True


class _FakeCommands:
    def __init__(self, server: FakeE2BServer, state: _State) -> None:
        self.server = server
        self.state = state

    @recorded("Commands.run")
    async def run(
        self,
        cmd: str,
        background: bool | None = None,
        envs: dict[str, str] | None = None,
        user: str | None = None,
        cwd: str | None = None,
        on_stdout: Any = None,
        on_stderr: Any = None,
        stdin: bool | None = None,
        timeout: float | None = 60,
        request_timeout: float | None = None,
        *,
        retain_output: bool = True,
    ) -> Any:
        state = self.server.live(self.state.id)
        if state is None:
            raise e2b.SandboxNotRunningException(f"sandbox {self.state.id} was not found")
        directory = state.host_path(cwd or state.workdir)
        directory.mkdir(parents=True, exist_ok=True)
        home = state.host_path(state.workdir)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), **state.envs, **(envs or {})}
        output = Path(tempfile.mkdtemp(prefix="cmd-", dir=self.server.root))
        with open(output / "stdout", "wb") as out, open(output / "stderr", "wb") as err:
            proc = subprocess.Popen(
                ["/bin/bash", "-c", cmd], cwd=directory, env=env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
            )  # fmt: skip
        state.procs.add(proc)
        handle = _FakeHandle(self.server, proc, timeout, output)
        return handle if background else await handle.wait()


class _FakeFiles:
    def __init__(self, server: FakeE2BServer, state: _State) -> None:
        self.server = server
        self.state = state

    def _state(self) -> _State:
        state = self.server.live(self.state.id)
        if state is None:
            raise e2b.SandboxNotRunningException(f"sandbox {self.state.id} was not found")
        return state

    @recorded("Filesystem.read")
    async def read(self, path: str, format: str = "text", user: str | None = None, **_: Any) -> Any:
        target = self._state().host_path(path)
        if not target.is_file():
            raise e2b.FileNotFoundException(f"file {path} not found")
        data = target.read_bytes()
        return bytearray(data) if format == "bytes" else data.decode()

    @recorded("Filesystem.write")
    async def write(self, path: str, data: str | bytes, user: str | None = None, **_: Any) -> None:
        target = self._state().host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)


class _FakePaginator:
    def __init__(self, server: FakeE2BServer, items: list[Any], limit: int) -> None:
        self.server = server
        self._items = items
        self._limit = limit
        self.has_next = True

    @recorded("AsyncSandboxPaginator.next_items")
    async def next_items(self) -> list[Any]:
        page, self._items = self._items[: self._limit], self._items[self._limit :]
        self.has_next = bool(self._items)
        return page


class _FakeSandbox:
    server: ClassVar[FakeE2BServer]

    def __init__(self, state: _State) -> None:
        self.sandbox_id = state.id
        self.traffic_access_token = state.traffic_token
        self.commands = _FakeCommands(self.server, state)
        self.files = _FakeFiles(self.server, state)
        self._domain = state.domain

    @classmethod
    @recorded("AsyncSandbox.create")
    async def create(
        cls,
        template: str | None = None,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        allow_internet_access: bool | None = None,
        network: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        **opts: Any,
    ) -> _FakeSandbox:
        server = cls.server
        server.in_flight_creates += 1
        server.max_in_flight_creates = max(server.max_in_flight_creates, server.in_flight_creates)
        try:
            server.check(opts)
            await asyncio.sleep(server.create_latency_s / 2)
            if server.fail_next:
                raise server.fail_next.pop(0)
            known = server.idempotency.get(idempotency_key or "")
            state = server.live(known) if known else None
            if state is None:
                state = cls._new_state(
                    template, timeout, metadata, envs, allow_internet_access, network, opts
                )
                if idempotency_key:
                    server.idempotency[idempotency_key] = state.id
            await asyncio.sleep(server.create_latency_s / 2)
            return cls(state)
        finally:
            server.in_flight_creates -= 1

    @classmethod
    def _new_state(
        cls,
        template: str | None,
        timeout: int | None,
        metadata: dict[str, str] | None,
        envs: dict[str, str] | None,
        allow_internet_access: bool | None,
        network: dict[str, Any] | None,
        opts: dict[str, Any],
    ) -> _State:
        server = cls.server
        if template is not None and template not in server.templates:
            raise e2b.SandboxException(f"404: template '{template}' not found", status_code=404)
        sandbox_id = "i" + secrets.token_hex(9)
        root = server.root / "sandboxes" / sandbox_id
        if template is not None:
            shutil.copytree(server.templates[template], root, symlinks=True)
        state = _State(
            id=sandbox_id,
            root=root,
            workdir=server.workdir,
            metadata=dict(metadata or {}),
            envs=dict(envs or {}),
            expires_at=time.monotonic() + (timeout or 300),
            domain=opts.get("domain") or "e2b.app",
            allow_internet_access=allow_internet_access,
            traffic_token=None
            if (network or {}).get("allow_public_traffic", True)
            else secrets.token_hex(16),
            template=template,
        )
        state.host_path(state.workdir).mkdir(parents=True, exist_ok=True)
        server.sandboxes[sandbox_id] = state
        return state

    @classmethod
    @recorded("AsyncSandbox.kill")
    async def kill(cls, sandbox_id: str, **opts: Any) -> bool:
        cls.server.check(opts)
        state = cls.server.live(sandbox_id)
        if state is None:
            return False
        cls.server.remove(state)
        return True

    @classmethod
    @recorded("AsyncSandbox.set_timeout")
    async def set_timeout(cls, sandbox_id: str, timeout: int, **opts: Any) -> None:
        cls.server.check(opts)
        state = cls.server.live(sandbox_id)
        if state is None:
            raise e2b.SandboxNotFoundException(f"Sandbox {sandbox_id} not found")
        state.expires_at = time.monotonic() + timeout

    @classmethod
    @recorded("AsyncSandbox.list")
    def list(cls, query: Any = None, limit: int | None = None, **opts: Any) -> _FakePaginator:
        cls.server.check(opts)
        cls.server.expire()
        wanted = (query.metadata if query is not None else None) or {}
        items = [
            _info(state)
            for state in cls.server.sandboxes.values()
            if all(state.metadata.get(k) == v for k, v in wanted.items())
        ]
        return _FakePaginator(cls.server, items, limit or 100)

    @recorded("AsyncSandbox.get_host")
    def get_host(self, port: int) -> str:
        return f"{port}-{self.sandbox_id}.{self._domain}"


def _info(state: _State) -> _SdkSandboxInfo:
    now = time.time()
    return _SdkSandboxInfo(
        sandbox_id=state.id,
        sandbox_domain=state.domain,
        template_id=state.template or "base",
        name=state.template,
        metadata=dict(state.metadata),
        started_at=datetime.fromtimestamp(now, tz=UTC),
        end_at=datetime.fromtimestamp(now + state.expires_at - time.monotonic(), tz=UTC),
        state=e2b.SandboxState.RUNNING,
        cpu_count=1,
        memory_mb=1024,
        envd_version="0.0.0",
    )


class _FakeTemplate:
    """Plays both ``AsyncTemplate`` (class methods) and the builder its methods return."""

    server: ClassVar[FakeE2BServer]

    @recorded("AsyncTemplate")
    def __init__(
        self, file_context_path: str | None = None, file_ignore_patterns: list[str] | None = None
    ) -> None:
        self.context = Path(file_context_path or ".")
        self.base: str | None = None
        self.instructions: list[tuple[str, Any]] = []

    @recorded("AsyncTemplate.from_image")
    def from_image(
        self, image: str, username: str | None = None, password: str | None = None
    ) -> _FakeTemplate:
        self.base = image
        return self

    @recorded("TemplateBuilder.set_user")
    def set_user(self, user: str) -> _FakeTemplate:
        self.instructions.append(("USER", user))
        return self

    @recorded("TemplateBuilder.set_workdir")
    def set_workdir(self, workdir: str) -> _FakeTemplate:
        self.instructions.append(("WORKDIR", workdir))
        return self

    @recorded("TemplateBuilder.run_cmd")
    def run_cmd(self, command: str, user: str | None = None) -> _FakeTemplate:
        self.instructions.append(("RUN", command))
        return self

    @recorded("TemplateBuilder.copy")
    def copy(
        self,
        src: str,
        dest: str,
        force_upload: Any = None,
        user: Any = None,
        mode: int | None = None,
        **_: Any,
    ) -> _FakeTemplate:
        self.instructions.append(("COPY", (dest, (self.context / src).read_bytes(), mode)))
        return self

    @classmethod
    @recorded("AsyncTemplate.build")
    async def build(cls, template: _FakeTemplate, name: str | None = None, **opts: Any) -> None:
        server = cls.server
        server.check(opts)
        assert name, "build needs a name"
        fs = server.root / "templates" / name
        shutil.rmtree(fs, ignore_errors=True)
        cwd = fs / server.workdir.lstrip("/")
        cwd.mkdir(parents=True)
        for kind, arg in template.instructions:
            if kind == "WORKDIR":
                cwd = fs / arg.lstrip("/")
                cwd.mkdir(parents=True, exist_ok=True)
            elif kind == "COPY":
                dest, content, mode = arg
                target = fs / dest.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
                os.chmod(target, mode or 0o644)
            elif kind == "RUN":
                done = await asyncio.to_thread(
                    subprocess.run, ["/bin/bash", "-c", arg], cwd=cwd, capture_output=True
                )
                if done.returncode != 0:
                    raise e2b.BuildException(f"step {arg!r} failed: {done.stderr.decode(errors='replace')}")
        if opts.get("on_build_logs"):
            opts["on_build_logs"](f"built {name}")
        server.templates[name] = fs
        server.builds.append(name)

    @classmethod
    @recorded("AsyncTemplate.exists")
    async def exists(cls, name: str, **opts: Any) -> bool:
        cls.server.check(opts)
        return name in cls.server.templates
