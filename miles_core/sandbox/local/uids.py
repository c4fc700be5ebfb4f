"""Per-sandbox host uids, claimed in one registry per host (root only).

Running as root, each local sandbox runs as a host uid of its own from :data:`UID_BASE`. Every
miles process on the host -- whatever its state root (``MILES_SANDBOX_ROOT``) -- claims uids in
the same directory, :func:`registry_dir`, under an exclusive ``flock`` of its ``lock`` file:
one file per claimed uid, naming the state root and sandbox that hold it and the process that
claimed it. A claim is released when its sandbox is destroyed; a claim whose sandbox no longer
exists, whose claiming process is gone and whose uid runs no process is stale, and is reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from miles_core.errors import ConfigError
from miles_core.sandbox.errors import SandboxCapacityError
from miles_core.sandbox.ownership import process_alive, process_start_time

#: first uid handed to sandboxes when running as root; UID_SLOTS uids from there
UID_BASE = 1_900_000
UID_SLOTS = 65_536
ENV_REGISTRY = "MILES_SANDBOX_UID_REGISTRY"
DEFAULT_REGISTRY = "/run/miles-sandbox/uids"


def registry_dir() -> Path:
    return Path(os.environ.get(ENV_REGISTRY) or DEFAULT_REGISTRY)


@dataclass(frozen=True)
class Claim:
    uid: int
    root: str  # the state root of the sandbox that holds the uid
    sandbox: str
    pid: int  # the process that claimed it
    pid_start: str
    at: float


def uid_in_use(uid: int) -> bool:
    """Whether any process on the host runs with ``uid`` (real, effective or saved)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"Uid:"):
                        if str(uid).encode() in line.split()[1:4]:
                            return True
                        break
        except OSError:
            continue
    return False


class UidRegistry:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or registry_dir()
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = os.lstat(self.path)
        except OSError as exc:
            raise ConfigError(f"sandbox uid registry {self.path}: {exc.strerror}; set {ENV_REGISTRY}") from None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o022:
            raise ConfigError(
                f"sandbox uid registry {self.path} must be a directory owned by uid {os.geteuid()} and "
                f"writable by it alone (not a symlink); set {ENV_REGISTRY}"
            )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self, uid: int) -> Claim | None:
        try:
            return Claim(**json.loads((self.path / str(uid)).read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):  # torn or foreign content: treat as held by nobody known
            return Claim(uid, "", "", 0, "", 0.0)

    def _write(self, claim: Claim) -> None:
        target = self.path / str(claim.uid)
        temporary = self.path / f".{claim.uid}.{os.getpid()}.tmp"
        temporary.write_text(json.dumps(asdict(claim)))
        os.replace(temporary, target)

    def stale(self, claim: Claim) -> bool:
        """The sandbox that claimed it is gone, its claimer too, and nothing runs as the uid."""
        if claim.pid and process_alive(claim.pid, claim.pid_start):
            return False
        if claim.root and claim.sandbox:
            meta = Path(claim.root) / "sandboxes" / claim.sandbox / "meta.json"
            try:
                if json.loads(meta.read_text()).get("uid") == claim.uid:
                    return False
            except (OSError, ValueError):
                pass
        return not uid_in_use(claim.uid)

    def claim(self, root: Path, sandbox_id: str) -> int:
        """A uid no live sandbox on this host holds, now held by ``sandbox_id`` of ``root``."""
        me = os.getpid()
        start = secrets.randbelow(UID_SLOTS)
        with self._locked():
            for offset in range(UID_SLOTS):
                uid = UID_BASE + (start + offset) % UID_SLOTS
                held = self._read(uid)
                if held is not None and not self.stale(held):
                    continue
                self._write(Claim(uid, str(root), sandbox_id, me, process_start_time(me) or "", time.time()))
                return uid
        raise SandboxCapacityError(f"all {UID_SLOTS} sandbox uids are in use", provider="local")

    def release(self, uid: int, root: Path, sandbox_id: str) -> None:
        """Drop the claim if ``sandbox_id`` of ``root`` still holds it (idempotent)."""
        with self._locked():
            held = self._read(uid)
            if held is not None and (held.root, held.sandbox) == (str(root), sandbox_id):
                (self.path / str(uid)).unlink(missing_ok=True)

    def claims(self, root: Path | None = None) -> list[Claim]:
        """Every claim (of ``root`` only, when given)."""
        out = []
        for entry in os.scandir(self.path):
            held = self._read(int(entry.name)) if entry.name.isdigit() else None
            if held is not None and (root is None or held.root == str(root)):
                out.append(held)
        return out
