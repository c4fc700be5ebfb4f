"""cgroup v2 limits for local sandboxes, where the host delegates a cgroup to miles.

With a usable *parent* cgroup, each sandbox gets a cgroup of its own below it, and its memory
and process limits cover all of its processes together (``memory.max`` with no swap,
``pids.max``), its CPU share follows its image's ``Resources.cpus`` (``cpu.max``). A parent is
usable when it is a cgroup v2 directory this process may write, with the ``memory`` and ``pids``
controllers enabled for its children (``cgroup.subtree_control``); it is

* the provider option ``cgroup`` or ``MILES_SANDBOX_CGROUP`` (e.g. a systemd unit's delegated
  cgroup: ``systemd-run -p Delegate=yes ...``), or
* as root, ``miles-sandbox`` below the cgroup v2 root, created here when that root offers the
  controllers (a cgroup with processes cannot delegate them: inside most containers it cannot).

Otherwise (cgroup v1 hosts, no delegation) the limits are rlimits of each process, as for the
``process`` isolation.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

ENV_CGROUP = "MILES_SANDBOX_CGROUP"
REQUIRED = frozenset({"memory", "pids"})
AUTO_NAME = "miles-sandbox"
PERIOD_US = 100_000
MB = 1 << 20


@dataclass(frozen=True)
class CgroupParent:
    path: Path
    controllers: frozenset[str]

    def to_dict(self) -> dict[str, object]:
        return {"path": str(self.path), "controllers": sorted(self.controllers)}


def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted in this mount namespace (or None)."""
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                before, _, after = line.partition(" - ")
                if after.split(" ", 1)[0] == "cgroup2":
                    return Path(before.split()[4])
    except OSError:
        return None
    return None


def _controllers(path: Path, name: str) -> frozenset[str]:
    try:
        return frozenset((path / name).read_text().split())
    except OSError:
        return frozenset()


def _usable(path: Path) -> tuple[CgroupParent | None, str]:
    mount = cgroup2_mount()
    if mount is None:
        return None, "no cgroup v2 hierarchy is mounted"
    resolved = path.resolve()
    if resolved != mount and mount not in resolved.parents:
        return None, f"{path} is not inside the cgroup v2 hierarchy at {mount}"
    enabled = _controllers(resolved, "cgroup.subtree_control")
    if not enabled >= REQUIRED:
        return None, f"{path} does not enable {sorted(REQUIRED - enabled)} for its children"
    if not os.access(resolved, os.W_OK | os.X_OK):
        return None, f"{path} is not writable by uid {os.geteuid()}"
    return CgroupParent(resolved, enabled), f"cgroup v2 at {resolved}"


def find_parent(option: str | None = None) -> tuple[CgroupParent | None, str]:
    """The parent for sandbox cgroups, and why it is (or why there is none).

    ``option``: a path (must be usable, else the reason says why), ``"none"``, or ``None``/
    ``"auto"`` (``MILES_SANDBOX_CGROUP``, then the root's ``miles-sandbox``)."""
    if option == "none":
        return None, "cgroups off (option cgroup=none)"
    configured = option if option not in (None, "auto") else os.environ.get(ENV_CGROUP)
    if configured:
        return _usable(Path(configured))
    mount = cgroup2_mount()
    if mount is None:
        return None, "no cgroup v2 hierarchy is mounted (cgroup v1 host)"
    if os.geteuid() != 0:
        return None, f"no delegated cgroup (set {ENV_CGROUP} to one whose subtree_control enables memory and pids)"
    if not _controllers(mount, "cgroup.controllers") >= REQUIRED:
        return None, f"the cgroup v2 root {mount} offers {sorted(_controllers(mount, 'cgroup.controllers'))}"
    parent = mount / AUTO_NAME
    try:
        parent.mkdir(mode=0o755, exist_ok=True)
        wanted = REQUIRED | ({"cpu"} & _controllers(parent, "cgroup.controllers"))
        missing = wanted - _controllers(parent, "cgroup.subtree_control")
        if missing:
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(missing)))
    except OSError as exc:
        return None, f"cannot set up {parent}: {exc.strerror}"
    return _usable(parent)


def create(parent: CgroupParent, sandbox_id: str, *, memory_mb: int, processes: int, cpus: float | None) -> Path:
    """A cgroup for one sandbox with its limits written; returns its directory."""
    path = parent.path / f"sbx-{sandbox_id}"
    path.mkdir(mode=0o755)
    try:
        (path / "memory.max").write_text(str(memory_mb * MB))
        swap = path / "memory.swap.max"
        if swap.exists():
            swap.write_text("0")
        (path / "pids.max").write_text(str(processes))
        if cpus is not None and "cpu" in parent.controllers:
            (path / "cpu.max").write_text(f"{int(cpus * PERIOD_US)} {PERIOD_US}")
    except OSError:
        remove(path)
        raise
    return path


def remove(path: Path, timeout: float = 5.0) -> None:
    """Remove a sandbox's cgroup once its last process is gone (a cgroup with members cannot)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def read_limits(path: Path) -> dict[str, str]:
    """The limit files of a sandbox's cgroup, as the kernel reports them."""
    out = {}
    for name in ("memory.max", "memory.swap.max", "pids.max", "cpu.max"):
        try:
            out[name] = (path / name).read_text().strip()
        except OSError:
            continue
    return out
