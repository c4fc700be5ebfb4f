"""The local provider's state on disk: one directory per sandbox, one per image.

Layout under the root (default ``$TMPDIR/miles-sandbox-<uid>``, or ``MILES_SANDBOX_ROOT``)::

    sandboxes/<id>/meta.json   labels, deadline, uid, limits, env (root-only, 0600)
    sandboxes/<id>/work/       the sandbox's working directory (owned by its uid)
    uids/<uid> -> <id>         claims on per-sandbox uids (symlink creation is atomic)
    images/<digest>/           finished images (a rename makes them appear whole)
    images/<digest>.lock       serialises builds of one digest across processes

The files *are* the state: listing reads ``meta.json``, and a supervisor can destroy any
sandbox from its metadata alone (its own, an orphan found by a sweep, or one whose supervisor
died -- reaped when the next supervisor starts).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError
from miles_core.fileio import write_bytes_atomic
from miles_core.sandbox.errors import SandboxCapacityError
from miles_core.sandbox.local.isolation import UID_BASE, UID_SLOTS, kill_sandbox_processes, kill_uid
from miles_core.sandbox.ownership import process_alive

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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Meta:
        return cls(**data)


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sandboxes = root / "sandboxes"
        self.uids = root / "uids"
        self.images = root / "images"
        for path in (root, self.sandboxes, self.uids, self.images):
            _private_dir(path)
        if os.geteuid() == 0:
            _check_traversable(root)

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
        """A uid no other live sandbox holds (claimed by an atomic symlink)."""
        start = secrets.randbelow(UID_SLOTS)
        for offset in range(UID_SLOTS):
            uid = UID_BASE + (start + offset) % UID_SLOTS
            try:
                os.symlink(sandbox_id, self.uids / str(uid))
                return uid
            except FileExistsError:
                continue
        raise SandboxCapacityError(f"all {UID_SLOTS} sandbox uids are in use", provider="local")

    def remove(self, meta: Meta) -> bool:
        """Kill every process of the sandbox, then delete it. Idempotent; True if it existed."""
        if meta.uid is not None:
            kill_uid(meta.uid)
        else:
            kill_sandbox_processes(meta.id)
        directory = self.sandbox_dir(meta.id)
        try:
            os.unlink(directory / "meta.json")
            existed = True
        except FileNotFoundError:
            existed = False
        if meta.uid is not None:
            try:
                os.unlink(self.uids / str(meta.uid))
            except FileNotFoundError:
                pass
        remove_tree(directory)
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
