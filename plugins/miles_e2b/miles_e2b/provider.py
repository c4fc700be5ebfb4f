"""The ``e2b`` sandbox provider: E2B Cloud or self-hosted AgentENV through the async SDK.

Everything is native ``async`` (``AsyncSandbox``/``AsyncTemplate``), so no create or build ever
sits in a thread the caller cannot cancel; cancellation safety, retries and keepalive come from
the core lifecycle layer. Mapping onto the SDK:

* images: an ``AsyncTemplate`` built under the recipe's digest name (``miles-<24 hex>``): the
  base image, ``set_user`` *before* any step (the build user is part of the digest),
  ``set_workdir`` to the sandboxes' working directory, then the steps in order (``Copy`` steps
  through the template's file context, by content hash). A name that ``exists`` is reused.
* create: ``timeout`` is the TTL (re-armed by ``set_timeout``), labels are ``metadata``, the
  lifecycle layer's create id is the ``idempotency_key``, ``network=False`` denies egress, and
  exposed ports need the sandbox's traffic token unless ``public_traffic`` is set.
* exec: per-exec limits are applied with bash's ``ulimit`` before the command.
"""

from __future__ import annotations

import asyncio
import builtins
import math
import posixpath
import shlex
import tempfile
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, TypeVar

from miles_core.sandbox.base import (
    LABEL_CREATE,
    Capabilities,
    Command,
    Copy,
    Endpoint,
    ExecResult,
    ImageRef,
    ImageSpec,
    Limits,
    SandboxInfo,
    SandboxRef,
    SandboxSpec,
)
from miles_core.sandbox.errors import SandboxError, SandboxUnsupported
from miles_core.sandbox.secrets import Secret, get_logger
from miles_e2b import sdk as surface
from miles_e2b.config import E2BConfig

T = TypeVar("T")
log = get_logger(__name__)
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
LIST_PAGE = 100
CAPABILITIES = Capabilities(
    ttl="rearmable",
    network_isolation=True,
    expose=True,
    custom_base_images=True,
    background_exec=True,
    limits=frozenset({"cpu_seconds", "memory_mb", "file_size_mb", "open_files"}),
    users=None,
    # a microVM per sandbox: nothing of the trainer's host is inside it (no process limit is
    # enforced, so the fork-loop probe is not claimed)
    isolates=frozenset(
        {
            "environ",
            "signal",
            "other_sandbox",
            "escape_destroy",
            "leftover_files",
            "network",
            "host_processes",
            "host_files",
        }
    ),
)


def raise_unchained(error: SandboxError) -> NoReturn:
    """Raise ``error`` outside the handler of the SDK exception it was made from: an SDK error
    may carry the API key (in its message, or its traceback's frames), and ``raise ... from
    None`` would still keep it as ``__context__``."""
    error.__cause__ = None
    error.__context__ = None
    raise error


def ulimit_prefix(limits: Limits) -> str:
    """bash ``ulimit`` line enforcing ``limits`` (-v in KiB, -f in 1 KiB blocks in bash)."""
    return (
        f"ulimit -t {limits.cpu_seconds} -v {limits.memory_mb * 1024} "
        f"-f {limits.file_size_mb * 1024} -n {limits.open_files} || exit 125\n"
    )


@dataclass
class _Live:
    sandbox: Any  # the SDK's AsyncSandbox
    limits: Limits
    user: str | None


class E2BProvider:
    name = "e2b"
    capabilities = CAPABILITIES

    def __init__(
        self, config: E2BConfig, *, sdk: ModuleType | Any | None = None, key: Secret | None = None
    ) -> None:
        self.config = config
        self.sdk = sdk if sdk is not None else surface.load()
        if sdk is None:
            config.check_environment()
        self._key = key or config.api_key.resolve()

    @property
    def _api(self) -> dict[str, Any]:
        """Connection keywords for one SDK call; built per call so that the key's value lives
        only inside its :class:`Secret` (which refuses to be pickled), not in this object."""
        return self.config.api_params(self._key)

    def __repr__(self) -> str:
        return f"E2BProvider(domain={self.config.domain!r}, api_url={self.config.api_url!r}, key={self.config.api_key})"

    async def _call(self, what: str, awaitable: Awaitable[T]) -> T:
        try:
            return await awaitable
        except (asyncio.CancelledError, SandboxError):
            raise
        except Exception as exc:
            error = surface.to_sandbox_error(exc, self.sdk, what)
        raise_unchained(error)

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else posixpath.join(self.config.workdir, path)

    @staticmethod
    def _live(ref: SandboxRef) -> _Live:
        if not isinstance(ref.native, _Live):
            raise SandboxUnsupported(
                f"sandbox {ref.id} was not created by this provider instance", provider="e2b"
            )
        return ref.native

    # -- images -----------------------------------------------------------------------------

    async def prepare_image(self, spec: ImageSpec) -> ImageRef:
        ref = ImageRef(self.name, spec.name, spec.digest)
        if await self._call(f"exists {spec.name}", self.sdk.AsyncTemplate.exists(spec.name, **self._api)):
            return ref
        with tempfile.TemporaryDirectory(prefix="miles-e2b-context-") as context:
            template = self.sdk.AsyncTemplate(file_context_path=context)
            builder = template.from_image(spec.base).set_user(spec.user).set_workdir(self.config.workdir)
            for step in spec.steps:
                if isinstance(step, Copy):
                    (Path(context) / step.sha256).write_bytes(step.content)
                    builder = builder.copy(step.sha256, self._path(step.dest), mode=step.mode)
                else:
                    builder = builder.run_cmd(step.cmd)
            resources = spec.resources
            await self._call(
                f"build template {spec.name}",
                self.sdk.AsyncTemplate.build(
                    builder,
                    spec.name,
                    cpu_count=resources.cpus,
                    memory_mb=resources.memory_mb,
                    min_free_disk_mb=resources.disk_mb,
                    on_build_logs=self._build_log,
                    **self._api,
                ),
            )
        return ref

    @staticmethod
    def _build_log(entry: Any) -> None:
        log.info("template build: %s", entry)

    # -- lifecycle --------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxRef:
        if spec.image is not None and spec.image.provider != self.name:
            raise SandboxUnsupported(
                f"image {spec.image.name} belongs to provider {spec.image.provider!r}", provider="e2b"
            )
        template = spec.image.name if spec.image is not None else self.config.template
        sandbox = await self._call(
            "create",
            self.sdk.AsyncSandbox.create(
                template=template,
                timeout=max(1, math.ceil(spec.ttl_s)),
                metadata=dict(spec.labels),
                envs=dict(spec.env),
                allow_internet_access=spec.network,
                network=None if self.config.public_traffic else {"allow_public_traffic": False},
                idempotency_key=spec.labels.get(LABEL_CREATE),
                **self._api,
            ),
        )
        live = _Live(sandbox, spec.limits, spec.user)
        return SandboxRef(sandbox.sandbox_id, self.name, dict(spec.labels), self.config.workdir, live)

    async def extend(self, sandbox_id: str, ttl_s: float) -> None:
        await self._call(
            f"set_timeout {sandbox_id}",
            self.sdk.AsyncSandbox.set_timeout(sandbox_id, max(1, math.ceil(ttl_s)), **self._api),
        )

    async def destroy(self, sandbox_id: str) -> bool:
        return bool(
            await self._call(f"kill {sandbox_id}", self.sdk.AsyncSandbox.kill(sandbox_id, **self._api))
        )

    async def list(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        query = self.sdk.SandboxQuery(metadata=dict(labels))
        try:
            paginator = self.sdk.AsyncSandbox.list(query=query, limit=LIST_PAGE, **self._api)
        except Exception as exc:
            error = surface.to_sandbox_error(exc, self.sdk, "list")
        else:
            return await self._pages(paginator)
        raise_unchained(error)

    async def _pages(self, paginator: Any) -> builtins.list[SandboxInfo]:  # list: the method above
        found: builtins.list[SandboxInfo] = []
        while paginator.has_next:
            for info in await self._call("list", paginator.next_items()):
                expires = info.end_at.timestamp() if info.end_at is not None else None
                state = getattr(info.state, "value", info.state)
                found.append(SandboxInfo(info.sandbox_id, dict(info.metadata or {}), expires, str(state)))
        return found

    async def aclose(self) -> None:
        return None

    # -- inside a sandbox -------------------------------------------------------------------

    async def exec(
        self,
        ref: SandboxRef,
        cmd: Command,
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        background: bool = False,
    ) -> ExecResult:
        live = self._live(ref)
        line = cmd if isinstance(cmd, str) else shlex.join(cmd)
        started = time.monotonic()
        handle = await self._call(
            f"exec in {ref.id}",
            live.sandbox.commands.run(
                ulimit_prefix(live.limits) + line,
                background=True,  # a handle: the deadline is ours, and a timed-out command is killed
                envs=dict(env or {}),
                user=user or live.user,
                cwd=self._path(cwd) if cwd else self.config.workdir,
                timeout=0,
            ),
        )
        if background:
            return ExecResult(None, duration_s=time.monotonic() - started)
        waiting = asyncio.ensure_future(handle.wait())
        try:
            result = await asyncio.wait_for(asyncio.shield(waiting), timeout)
        except self.sdk.CommandExitException as exc:
            return self._result(live, exc.exit_code, exc.stdout, exc.stderr, started)
        except TimeoutError:
            await asyncio.shield(self._kill(handle, waiting))
            return ExecResult(None, timed_out=True, duration_s=time.monotonic() - started)
        except asyncio.CancelledError:
            try:
                await asyncio.shield(self._kill(handle, waiting))
            except SandboxError as kill_error:  # the cancellation is what the caller must see
                log.warning("could not kill a cancelled command in %s: %s", ref.id, kill_error)
            raise
        except Exception as exc:
            error = surface.to_sandbox_error(exc, self.sdk, f"exec in {ref.id}")
        else:
            return self._result(live, result.exit_code, result.stdout, result.stderr, started)
        raise_unchained(error)

    async def _kill(self, handle: Any, waiting: asyncio.Future[Any]) -> None:
        """Kill a command we stopped waiting for; its wait then ends with the kill."""
        await self._call("kill command", handle.kill())
        await asyncio.wait({waiting})
        if not waiting.cancelled():
            waiting.exception()  # retrieved: a killed command's exit is expected

    @staticmethod
    def _result(live: _Live, code: int, stdout: str | None, stderr: str | None, started: float) -> ExecResult:
        cap = live.limits.output_bytes
        out, err = stdout or "", stderr or ""
        truncated = len(out.encode()) > cap or len(err.encode()) > cap
        if truncated:
            out = out.encode()[:cap].decode(errors="ignore")
            err = err.encode()[:cap].decode(errors="ignore")
        return ExecResult(code, out, err, duration_s=time.monotonic() - started, truncated=truncated)

    async def write_file(self, ref: SandboxRef, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        live = self._live(ref)
        target = self._path(path)
        await self._call(f"write {path}", live.sandbox.files.write(target, data, user=live.user))
        if mode != 0o644:
            await self.exec(ref, ["chmod", format(mode, "o"), target])

    async def read_file(self, ref: SandboxRef, path: str) -> bytes:
        live = self._live(ref)
        data = await self._call(
            f"read {path}", live.sandbox.files.read(self._path(path), format="bytes", user=live.user)
        )
        return bytes(data)

    async def expose(self, ref: SandboxRef, port: int) -> Endpoint:
        live = self._live(ref)
        if not 0 < port < 65536:
            raise SandboxUnsupported(f"port {port} is not a TCP port", provider="e2b")
        url = f"{self.config.scheme}://{live.sandbox.get_host(port)}"
        token = live.sandbox.traffic_access_token
        headers = {TRAFFIC_TOKEN_HEADER: token} if token and not self.config.public_traffic else {}
        return Endpoint(url, headers)
