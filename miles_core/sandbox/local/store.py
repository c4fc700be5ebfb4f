"""The local provider's state on disk: one directory per sandbox, one per image.

Layout under the root (default ``$TMPDIR/miles-sandbox-<uid>``, or ``MILES_SANDBOX_ROOT``)::

    sandboxes/<id>/meta.json   labels, deadline, uid, isolation, init pid, limits, env (0600)
    sandboxes/<id>/work/       the sandbox's working directory (owned by its uid)
    sandboxes/<id>/root/       mount point of a namespace sandbox's root (unshare tool)
    sandboxes/<id>/bwrap.log   bwrap's own errors (bwrap tool)
    images/<digest>/           finished images (a rename makes them appear whole)
    images/<digest>.lock       serialises builds of one digest across processes
    bin/python, bin/python3    the interpreter of process-isolated sandboxes

Per-sandbox uids (root only) are claimed in the host-wide registry of
:mod:`miles_core.sandbox.local.uids`, shared by every state root.

The files *are* the state: listing reads ``meta.json``, and a supervisor can destroy any
sandbox from its metadata alone (its own, an orphan found by a sweep, or one whose supervisor
died -- reaped when the next supervisor starts).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError
from miles_core.fileio import write_bytes_atomic
from miles_core.sandbox.local import cgroups
from miles_core.sandbox.local.isolation import EXIT_TIMEOUT_S, kill_sandbox_processes, kill_uid
from miles_core.sandbox.local.uids import UidRegistry
from miles_core.sandbox.ownership import process_alive, process_start_time

ENV_ROOT = "MILES_SANDBOX_ROOT"


def default_root() -> Path:
    configured = os.environ.get(ENV_ROOT)
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"miles-sandbox-{os.getuid()}"


@dataclass
class Meta:
    """Everything needed to run commands in, extend or destroy one sandbox."""

    id: str
    labels: dict[str, str]
    created_at: float
    expires_at: float
    uid: int | None
    network: bool
    limits: dict[str, int]
    env: dict[str, str] = field(default_factory=dict)
    supervisor_pid: int | None = None
    supervisor_start: str | None = None
    isolation: str = "process"  # or "namespaces"
    tool: str | None = None  # namespaces: "bwrap" or "unshare"
    tmpfs_mb: int = 256
    init_pid: int | None = None  # namespaces: the sandbox's pid 1, as the host sees it
    init_start: str | None = None
    keeper_pid: int | None = None  # namespaces: the host process holding the init
    keeper_start: str | None = None
    cgroup: str | None = None  # namespaces: the sandbox's own cgroup v2 directory
    cpus: float | None = None  # its image's Resources.cpus (cgroup cpu.max)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Meta:
        return cls(**data)


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sandboxes = root / "sandboxes"
        self.images = root / "images"
        self.bin = root / "bin"
        for path in (root, self.sandboxes, self.images, self.bin):
            _private_dir(path)
        self.registry: UidRegistry | None = None
        if os.geteuid() == 0:
            _check_traversable(root)
            self.registry = UidRegistry()

    # -- sandboxes --------------------------------------------------------------------------

    def new_id(self) -> str:
        return secrets.token_hex(8)

    def sandbox_dir(self, sandbox_id: str) -> Path:
        if not sandbox_id.isalnum():
            raise ValueError(f"not a local sandbox id: {sandbox_id!r}")
        return self.sandboxes / sandbox_id

    def workdir(self, sandbox_id: str) -> Path:
        return self.sandbox_dir(sandbox_id) / "work"

    def write_meta(self, meta: Meta) -> None:
        path = self.sandbox_dir(meta.id) / "meta.json"
        write_bytes_atomic(path, json.dumps(asdict(meta)).encode(), mode=0o600)

    def read_meta(self, sandbox_id: str) -> Meta | None:
        try:
            with open(self.sandbox_dir(sandbox_id) / "meta.json") as fh:
                return Meta.from_json(json.load(fh))
        except (FileNotFoundError, ValueError):
            return None

    def metas(self) -> list[Meta]:
        out = []
        for entry in os.scandir(self.sandboxes):
            if entry.name.isalnum() and (meta := self.read_meta(entry.name)) is not None:
                out.append(meta)
        return out

    def claim_uid(self, sandbox_id: str) -> int:
        """A host uid no other live sandbox holds, from the host-wide registry (root only)."""
        if self.registry is None:
            raise RuntimeError("per-sandbox uids need root")
        return self.registry.claim(self.root, sandbox_id)

    def remove(self, meta: Meta) -> bool:
        """Kill every process of the sandbox, then delete it. Idempotent; True if it existed.

        Call from the supervisor (killing a uid's processes forks)."""
        if meta.isolation == "namespaces":
            # the kernel ends the pid namespace with its init; the keeper then exits by itself
            # (its supervisor reaps it)
            if meta.init_pid is not None:
                kill_and_wait(meta.init_pid, meta.init_start)
            if meta.cgroup is not None:
                cgroups.remove(Path(meta.cgroup))
        elif meta.uid is not None:
            kill_uid(meta.uid)
        else:
            kill_sandbox_processes(meta.id)
        directory = self.sandbox_dir(meta.id)
        existed = (directory / "meta.json").exists()
        trash = self.sandboxes / f".removing-{meta.id}-{os.getpid()}"
        try:  # the sandbox vanishes at once, whole (listing skips the new name); then its files
            os.rename(directory, trash)
        except FileNotFoundError:
            trash = directory
        if meta.uid is not None and self.registry is not None:
            self.registry.release(meta.uid, self.root, meta.id)
        remove_tree(trash)
        return existed

    def reap_expired(self, now: float | None = None) -> list[str]:
        """Destroy sandboxes whose deadline passed and whose supervisor is gone."""
        now = time.time() if now is None else now
        reaped = []
        for meta in self.metas():
            supervised = meta.supervisor_pid is not None and process_alive(
                meta.supervisor_pid, meta.supervisor_start
            )
            if meta.expires_at <= now and not supervised:
                self.remove(meta)
                reaped.append(meta.id)
        return reaped

    # -- images -----------------------------------------------------------------------------

    def image_dir(self, digest: str) -> Path:
        return self.images / digest

    def image_resources(self, digest: str) -> dict[str, Any]:
        """The ``Resources`` an image's recipe asked for (empty if its recipe is not recorded)."""
        try:
            return dict(json.loads((self.images / f"{digest}.json").read_text()).get("resources") or {})
        except (OSError, ValueError):
            return {}


def kill_and_wait(pid: int, start: str | None, timeout: float = EXIT_TIMEOUT_S) -> bool:
    """SIGKILL ``pid`` if it is still the process that started at ``start`` and wait until it
    has exited (through a pidfd: a recycled pid is never signalled). True if it was alive.

    An init's exit completes only once every other process of its pid namespace is gone."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if start is not None and process_start_time(pid) != start:
            return False
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/pid")
        except OSError:  # gone meanwhile; the pidfd still says when it has exited
            namespace = None
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            return False
        ready, _, _ = select.select([pidfd], [], [], timeout)
        if not ready:
            held = _holding(namespace, pid) if namespace is not None else ""
            raise TimeoutError(f"process {pid} did not exit {timeout:g}s after SIGKILL{held}")
        return True
    finally:
        os.close(pidfd)


def _holding(namespace: str, init: int) -> str:
    """What keeps the pid namespace ``namespace`` of ``init`` alive: its other processes, their
    state and parent (a zombie is waiting for its parent to reap it)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == init:
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/pid") != namespace:
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        found.append(f"{entry.name} (state {fields[0].decode()}, parent {fields[1].decode()})")
    return f"; its pid namespace still holds {', '.join(found)}" if found else ""


def _private_dir(path: Path) -> None:
    """Create ``path`` (0711: sandbox uids may traverse, not list) and check we own it."""
    try:
        path.mkdir(mode=0o711, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"sandbox root {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ConfigError(
            f"sandbox root {path} must be a directory owned by uid {os.geteuid()} (not a symlink); "
            f"choose another with {ENV_ROOT}"
        )
    if stat.S_IMODE(info.st_mode) & 0o022:
        raise ConfigError(f"sandbox root {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})")


def _check_traversable(root: Path) -> None:
    """Sandbox uids reach their working directory by absolute path: every ancestor needs o+x."""
    for ancestor in [root.resolve(), *root.resolve().parents]:
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            raise ConfigError(
                f"sandbox root {root}: sandbox users cannot traverse {ancestor} (needs o+x); "
                f"choose another root with {ENV_ROOT}"
            )


def remove_tree(path: Path) -> None:
    """``rm -rf`` that also removes what a sandbox made unreadable (``chmod 000``)."""

    def fix_and_retry(func: Any, failed: str, _exc: Any) -> None:
        parent = os.path.dirname(failed)
        os.chmod(parent, stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, stat.S_IRWXU)
            shutil.rmtree(failed, onerror=fix_and_retry)
        elif os.path.lexists(failed):
            os.unlink(failed)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=fix_and_retry)
