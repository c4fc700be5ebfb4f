"""The ``local`` provider: sandboxes on this host, isolated by Linux namespaces or as processes.

``isolation``:

* ``"namespaces"`` (the default where the host supports it): each sandbox is its own user,
  pid, mount, network, IPC, UTS and cgroup namespace (:mod:`~miles_core.sandbox.local.namespaces`):
  it sees a read-only system, its working directory, private ``/tmp``/``/var/tmp``/``/dev/shm``
  and its own processes -- nothing of the host's files, processes or network.
* ``"process"``: a private working directory, resource limits, a uid of its own (as root) and a
  network namespace where permitted (:mod:`~miles_core.sandbox.local.isolation`); commands see
  the host's filesystem with their uid's permissions.

docs/sandbox.md states what each mode does and does not isolate. A supervisor process
(:mod:`~miles_core.sandbox.local.supervisor`) spawns every command and keeps the TTLs.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

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
from miles_core.sandbox.local import cgroups, files, namespaces
from miles_core.sandbox.local.client import SupervisorClient
from miles_core.sandbox.local.images import DEFAULT_PATH, ensure_image, populate
from miles_core.sandbox.local.isolation import MARKER_VAR, is_root, network_isolation_available
from miles_core.sandbox.local.store import Meta, Store, default_root
from miles_core.sandbox.ownership import process_start_time
from miles_core.sandbox.secrets import get_logger

log = get_logger(__name__)
SANDBOX_USER = namespaces.SANDBOX_USER
Isolation = Literal["namespaces", "process"]
ISOLATIONS = ("namespaces", "process")
TOOLS = ("auto", "bwrap", "unshare")
#: the hostile probes of :mod:`miles_core.testing.sandbox` each mode stops
NAMESPACE_ISOLATES = frozenset(
    {
        "environ",
        "signal",
        "other_sandbox",
        "escape_destroy",
        "leftover_files",
        "fork_loop",
        "network",
        "host_processes",
        "host_files",
    }
)
_fallback_logged: set[str] = set()


def process_isolates(network_isolated: bool) -> frozenset[str]:
    """What the ``process`` mode stops: as root, what a uid of its own per sandbox gives."""
    found = {"network"} if network_isolated else set()
    if is_root():
        found |= {"environ", "signal", "other_sandbox", "escape_destroy", "fork_loop"}
    return frozenset(found)


class LocalProvider:
    name = "local"

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        isolation: Isolation | None = None,
        namespace_tool: str = "auto",
        isolate_network: bool | None = None,
        step_timeout_s: float = 1800.0,
        tmpfs_mb: int = 256,
        cgroup: str | None = None,
    ) -> None:
        self.store = Store(Path(root).absolute() if root is not None else default_root())
        if isolation is not None and isolation not in ISOLATIONS:
            raise SandboxUnsupported(
                f"isolation {isolation!r}: expected one of {', '.join(ISOLATIONS)}", provider="local"
            )
        if namespace_tool not in TOOLS:
            raise SandboxUnsupported(
                f"namespace_tool {namespace_tool!r}: expected one of {', '.join(TOOLS)}", provider="local"
            )
        if tmpfs_mb < 1:
            raise SandboxUnsupported(f"tmpfs_mb must be >= 1, got {tmpfs_mb}", provider="local")
        self.support = namespaces.support(namespace_tool) if isolation != "process" else None
        if isolation == "namespaces" and self.support is not None and not self.support.available:
            raise SandboxUnsupported(
                f"isolation='namespaces' is not available on this host ({self.support.detail}). "
                "Install bubblewrap or allow unprivileged user namespaces, or set isolation='process' "
                "(docs/sandbox.md says what it does not isolate)",
                provider="local",
            )
        if isolation is None:
            isolation = "namespaces" if self.support is not None and self.support.available else "process"
            if isolation == "process" and self.support is not None:
                reason = self.support.detail
                if reason not in _fallback_logged:
                    _fallback_logged.add(reason)
                    log.warning("local sandboxes fall back to isolation='process': %s", reason)
        self.isolation: Isolation = isolation
        self.tool = self.support.tool if isolation == "namespaces" and self.support is not None else None
        self._bwrap = namespaces.tool_path("bwrap") if self.tool == "bwrap" else None
        self.tmpfs_mb = tmpfs_mb
        self.step_timeout_s = step_timeout_s
        self.cgroup_parent: cgroups.CgroupParent | None = None
        self.cgroup_detail = "rlimits per process (isolation='process')"
        if isolation == "namespaces":
            self.cgroup_parent, self.cgroup_detail = cgroups.find_parent(cgroup)
            if self.cgroup_parent is None and cgroup not in (None, "auto", "none"):
                raise SandboxUnsupported(f"cgroup={cgroup!r} cannot hold sandboxes: {self.cgroup_detail}", provider="local")
        if isolation == "namespaces":
            if isolate_network is False:
                raise SandboxUnsupported(
                    "isolate_network=false needs isolation='process': a namespace sandbox always has its "
                    "own network unless it is created with network=True",
                    provider="local",
                )
            self.isolate_network = True
            processes = is_root() or namespaces.kernel_counts_processes_per_userns()
            isolates = NAMESPACE_ISOLATES if processes else NAMESPACE_ISOLATES - {"fork_loop"}
        else:
            available = network_isolation_available()
            if isolate_network and not available:
                raise SandboxUnsupported(
                    "isolate_network=true but this process may not create network namespaces (needs CAP_SYS_ADMIN)",
                    provider="local",
                )
            self.isolate_network = available if isolate_network is None else isolate_network
            processes = is_root()
            isolates = process_isolates(self.isolate_network)
        limits = set(LIMIT_NAMES) if processes else set(LIMIT_NAMES) - {"processes"}
        self.capabilities = Capabilities(
            ttl="rearmable",
            network_isolation=self.isolate_network,
            expose=True,
            custom_base_images=False,
            background_exec=True,
            limits=frozenset(limits),
            users=(SANDBOX_USER,),
            isolates=isolates,
        )
        self.python = namespaces.interpreter(is_root())
        if isolation == "process":
            self._link_interpreter()
        self._supervisor: SupervisorClient | None = None
        self._starting: asyncio.Lock | None = None
        self._metas: dict[str, Meta] = {}

    def __repr__(self) -> str:
        return f"LocalProvider(root={str(self.store.root)!r}, isolation={self.isolation!r})"

    def describe(self) -> dict[str, Any]:
        """How sandboxes are isolated here, and the interpreters they have (for reports)."""
        return {
            "isolation": self.isolation,
            "tool": self.tool,
            "tool_detail": self.support.detail if self.tool is not None and self.support else None,
            "namespaces": self.support.to_dict() if self.support is not None else None,
            "interpreters": self.python.to_dict() if self.python is not None else None,
            "path": self._path(),
            "limits_by": (
                f"cgroup v2 below {self.cgroup_parent.path} (memory, processes per sandbox) and rlimits"
                if self.cgroup_parent is not None
                else f"rlimits per process ({self.cgroup_detail})"
            ),
        }

    def _path(self) -> str:
        if self.isolation == "namespaces":
            return namespaces.SANDBOX_PATH
        return f"{self.store.bin}:{DEFAULT_PATH}"

    def _link_interpreter(self) -> None:
        """``python``/``python3`` on a process sandbox's PATH: the chosen interpreter."""
        for name in ("python", "python3"):
            link = self.store.bin / name
            target = self.python.executable if self.python is not None else None
            current = os.readlink(link) if os.path.islink(link) else None
            if current == target:
                continue
            if os.path.lexists(link):
                os.unlink(link)
            if target is not None:
                temporary = link.with_name(f".{name}.{os.getpid()}")
                os.symlink(target, temporary)
                os.replace(temporary, link)

    def host_workdir(self, ref: SandboxRef) -> str:
        """Where the sandbox's working directory lives on the host."""
        return str(self.store.workdir(ref.id))

    def _workdir_inside(self, sandbox_id: str) -> str:
        if self.isolation == "namespaces":
            return namespaces.WORKDIR
        return str(self.store.workdir(sandbox_id))

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
            isolation=self.isolation,
            tool=self.tool,
            tmpfs_mb=self.tmpfs_mb,
            cpus=float(self.store.image_resources(spec.image.digest).get("cpus", 1)) if spec.image else None,
        )
        try:
            if is_root():
                meta.uid = self.store.claim_uid(sandbox_id)
            self.store.write_meta(meta)
            await asyncio.to_thread(populate, image, self.store.workdir(sandbox_id), meta.uid)
            await client.call(
                "track",
                id=sandbox_id,
                isolate=self.isolate_network and not spec.network,
                bwrap=self._bwrap,
                cgroup=str(self.cgroup_parent.path) if self.cgroup_parent is not None else None,
            )
        except BaseException:
            await asyncio.shield(client.call("destroy", id=sandbox_id))
            raise
        self._metas[sandbox_id] = meta
        return SandboxRef(sandbox_id, self.name, dict(spec.labels), self._workdir_inside(sandbox_id))

    async def extend(self, sandbox_id: str, ttl_s: float) -> None:
        await (await self._client()).call("extend", id=sandbox_id, ttl=ttl_s)

    async def destroy(self, sandbox_id: str) -> bool:
        """Destroy through the supervisor, also for orphans found by ``list()``: killing a
        sandbox's processes forks, which only the single-threaded supervisor may do."""
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
        inside = self._workdir_inside(ref.id)
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        full_env = {
            "PATH": self._path(),
            "HOME": inside,
            "TMPDIR": "/tmp" if self.isolation == "namespaces" else inside,
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
            cwd=os.path.join(inside, cwd) if cwd else inside,
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
            files.write_file,
            self.store.workdir(ref.id),
            path,
            payload,
            mode=mode,
            owner=meta.uid,
            visible=self._workdir_inside(ref.id),
        )

    async def read_file(self, ref: SandboxRef, path: str) -> bytes:
        meta = self._meta(ref)
        return await asyncio.to_thread(
            files.read_file,
            self.store.workdir(ref.id),
            path,
            visible=self._workdir_inside(ref.id),
            owner=meta.uid,
        )

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
