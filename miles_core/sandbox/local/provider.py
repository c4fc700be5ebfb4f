"""The ``local`` provider: a private working directory and a supervised process per exec.

See :mod:`miles_core.sandbox.local.isolation` for what is enforced, and
:mod:`miles_core.sandbox.local.supervisor` for why a supervisor process spawns the commands and
keeps the TTLs. The local provider is a *process* sandbox: limits, a private directory, its own
uid (as root) and network namespace -- not a container; commands see the host's filesystem
with their uid's permissions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path

from miles_core.sandbox.base import (
    LIMIT_NAMES,
    Capabilities,
    Command,
    Endpoint,
    ExecResult,
    ImageRef,
    ImageSpec,
    SandboxInfo,
    SandboxRef,
    SandboxSpec,
)
from miles_core.sandbox.errors import SandboxNotFound, SandboxUnsupported
from miles_core.sandbox.local import files
from miles_core.sandbox.local.client import SupervisorClient
from miles_core.sandbox.local.images import DEFAULT_PATH, ensure_image, populate
from miles_core.sandbox.local.isolation import MARKER_VAR, is_root, network_isolation_available
from miles_core.sandbox.local.store import Meta, Store, default_root
from miles_core.sandbox.ownership import process_start_time

SANDBOX_USER = "sandbox"


class LocalProvider:
    name = "local"

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        isolate_network: bool | None = None,
        step_timeout_s: float = 1800.0,
    ) -> None:
        self.store = Store(Path(root) if root is not None else default_root())
        available = network_isolation_available()
        if isolate_network and not available:
            raise SandboxUnsupported(
                "isolate_network=true but this process may not create network namespaces (needs CAP_SYS_ADMIN)",
                provider="local",
            )
        self.isolate_network = available if isolate_network is None else isolate_network
        self.step_timeout_s = step_timeout_s
        limits = set(LIMIT_NAMES) if is_root() else set(LIMIT_NAMES) - {"processes"}
        self.capabilities = Capabilities(
            ttl="rearmable",
            network_isolation=self.isolate_network,
            expose=True,
            custom_base_images=False,
            background_exec=True,
            limits=frozenset(limits),
            users=(SANDBOX_USER,),
        )
        self._supervisor: SupervisorClient | None = None
        self._starting: asyncio.Lock | None = None
        self._metas: dict[str, Meta] = {}

    def __repr__(self) -> str:
        return f"LocalProvider(root={str(self.store.root)!r})"

    async def _client(self) -> SupervisorClient:
        if self._supervisor is None:
            self._starting = self._starting or asyncio.Lock()
            async with self._starting:
                if self._supervisor is None:
                    self._supervisor = await SupervisorClient.start(self.store.root)
        return self._supervisor

    # -- images -----------------------------------------------------------------------------

    async def prepare_image(self, spec: ImageSpec) -> ImageRef:
        await asyncio.to_thread(ensure_image, self.store, spec, step_timeout_s=self.step_timeout_s)
        return ImageRef(self.name, spec.name, spec.digest)

    # -- lifecycle --------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxRef:
        image = None
        if spec.image is not None:
            if spec.image.provider != self.name:
                raise SandboxUnsupported(
                    f"image {spec.image.name} belongs to provider {spec.image.provider!r}", provider=self.name
                )
            image = self.store.image_dir(spec.image.digest)
            if not image.is_dir():
                raise SandboxNotFound(
                    f"image {spec.image.name} is not prepared on this host", provider=self.name
                )
        if spec.user not in (None, SANDBOX_USER):
            raise SandboxUnsupported(
                f"user {spec.user!r}: local sandboxes run as {SANDBOX_USER!r}", provider=self.name
            )
        client = await self._client()
        sandbox_id = self.store.new_id()
        self.store.sandbox_dir(sandbox_id).mkdir(mode=0o711)
        meta = Meta(
            id=sandbox_id,
            labels=dict(spec.labels),
            created_at=time.time(),
            expires_at=time.time() + spec.ttl_s,
            uid=None,
            network=spec.network,
            limits={name: getattr(spec.limits, name) for name in (*LIMIT_NAMES, "output_bytes")},
            env=dict(spec.env),
            supervisor_pid=client.pid,
            supervisor_start=process_start_time(client.pid),
        )
        try:
            if is_root():
                meta.uid = self.store.claim_uid(sandbox_id)
            self.store.write_meta(meta)
            await asyncio.to_thread(populate, image, self.store.workdir(sandbox_id), meta.uid)
            await client.call("track", id=sandbox_id, isolate=self.isolate_network and not spec.network)
        except BaseException:
            await client.call("destroy", id=sandbox_id)
            raise
        self._metas[sandbox_id] = meta
        return SandboxRef(sandbox_id, self.name, dict(spec.labels), str(self.store.workdir(sandbox_id)))

    async def extend(self, sandbox_id: str, ttl_s: float) -> None:
        await (await self._client()).call("extend", id=sandbox_id, ttl=ttl_s)

    async def destroy(self, sandbox_id: str) -> bool:
        """Destroy through the supervisor, also for orphans found by ``list()``: killing a
        sandbox uid's processes forks, which only the single-threaded supervisor may do."""
        self._metas.pop(sandbox_id, None)
        reply = await (await self._client()).call("destroy", id=sandbox_id)
        return bool(reply["existed"])

    async def list(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        metas = await asyncio.to_thread(self.store.metas)
        return [
            SandboxInfo(m.id, m.labels, m.expires_at)
            for m in metas
            if all(m.labels.get(k) == v for k, v in labels.items())
        ]

    async def aclose(self) -> None:
        if self._supervisor is not None:
            await self._supervisor.aclose()
            self._supervisor = None

    # -- inside a sandbox -------------------------------------------------------------------

    def _meta(self, ref: SandboxRef) -> Meta:
        meta = self._metas.get(ref.id)
        if meta is None:
            raise SandboxNotFound(f"sandbox {ref.id} is not live in this provider", provider=self.name)
        return meta

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
        meta = self._meta(ref)
        if user not in (None, SANDBOX_USER):
            raise SandboxUnsupported(
                f"user {user!r}: local sandboxes run as {SANDBOX_USER!r}", provider=self.name
            )
        workdir = self.store.workdir(ref.id)
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        full_env = {
            "PATH": DEFAULT_PATH,
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            **meta.env,
            **(env or {}),
            MARKER_VAR: ref.id,
        }
        reply = await (await self._client()).call(
            "exec",
            id=ref.id,
            argv=argv,
            env=full_env,
            cwd=str(workdir / cwd) if cwd else str(workdir),
            timeout=timeout,
            background=background,
        )
        return ExecResult(
            exit_code=reply["exit_code"],
            stdout=reply["stdout"],
            stderr=reply["stderr"],
            timed_out=reply["timed_out"],
            duration_s=reply["duration_s"],
            truncated=reply["truncated"],
        )

    async def write_file(self, ref: SandboxRef, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        meta = self._meta(ref)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        await asyncio.to_thread(
            files.write_file, self.store.workdir(ref.id), path, payload, mode=mode, owner=meta.uid
        )

    async def read_file(self, ref: SandboxRef, path: str) -> bytes:
        self._meta(ref)
        return await asyncio.to_thread(files.read_file, self.store.workdir(ref.id), path)

    async def expose(self, ref: SandboxRef, port: int) -> Endpoint:
        meta = self._meta(ref)
        if not 0 < port < 65536:
            raise SandboxUnsupported(f"port {port} is not a TCP port", provider=self.name)
        if self.isolate_network and not meta.network:
            raise SandboxUnsupported(
                f"sandbox {ref.id} has an isolated network (network=False): its ports are reachable only "
                "from inside it; create it with network=True to expose ports",
                provider=self.name,
            )
        return Endpoint(f"http://127.0.0.1:{port}")
