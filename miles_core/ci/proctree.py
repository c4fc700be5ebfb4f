"""Run a command so that every process it starts is killed when it ends: a small supervisor.

``python -m miles_core.ci.proctree -- CMD...`` runs ``CMD`` and, once it exits (or the
supervisor gets SIGTERM, SIGINT or SIGHUP), kills every process ``CMD`` started and waits for them,
then exits with ``CMD``'s status (``128 + N`` when it died of signal ``N``; ``128 + SIGTERM`` when
it was stopped). A process group or session is not enough: a child that calls ``setsid`` (a
daemon, a server started with ``start_new_session=True``) leaves both. So the supervisor tracks the
tree two ways:

* **a cgroup** (cgroup v2, where the supervisor may create one below its own): ``CMD`` joins it
  before it runs, so every descendant is in it however it detaches; it is killed with
  ``cgroup.kill`` (or process by process on kernels without it) and removed.
* **ancestry** (Linux, always): the supervisor is a child subreaper (``PR_SET_CHILD_SUBREAPER``),
  so a detached process whose parent exits is re-parented to the supervisor instead of to init,
  and stays its descendant; the whole descendant tree is found in ``/proc`` and killed until none
  is left.

Elsewhere (no ``/proc``, no ``prctl``) only the command's process group is killed.

Standard library only: the runner starts one supervisor per test file.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
#: how long the supervisor keeps killing before it gives up on a process that will not die
KILL_DEADLINE_S = 10.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def supervised(command: Sequence[str]) -> list[str]:
    """``command`` wrapped in the supervisor (same interpreter)."""
    return [sys.executable, "-m", "miles_core.ci.proctree", "--", *command]


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signum)


def set_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid`` from /proc, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def descendants(pid: int) -> list[int]:
    """Every live (not zombie) process below ``pid``, from one scan of /proc."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            info = _stat(int(entry.name))
            if info is not None:
                children.setdefault(info[0], []).append(int(entry.name))
                states[int(entry.name)] = info[1]
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), ()):
            found.append(child)
            frontier.append(child)
    return [p for p in found if states.get(p) != "Z"]


# -- cgroup v2 ----------------------------------------------------------------------------------


def new_cgroup() -> Path | None:
    """A fresh cgroup v2 below this process's own, or None where the unified hierarchy is not
    mounted at /sys/fs/cgroup or this process may not create one there."""
    base = Path("/sys/fs/cgroup")
    try:
        if not (base / "cgroup.controllers").is_file():
            return None  # not the unified (v2) hierarchy
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        own = next((line[3:] for line in lines if line.startswith("0::")), None)
        if own is None:
            return None
        group = base / own.lstrip("/") / f"miles-ci-{os.getpid()}"
        group.mkdir()
        return group
    except OSError:
        return None


def _cgroup_pids(group: Path) -> list[int]:
    try:
        return [int(line) for line in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _join(group: Path) -> None:
    (group / "cgroup.procs").write_text("0")


def _kill_cgroup(group: Path) -> None:
    try:
        (group / "cgroup.kill").write_text("1")
    except OSError:  # kernels before 5.14: no cgroup.kill
        for pid in _cgroup_pids(group):
            _kill(pid)


# -- killing --------------------------------------------------------------------------------------


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _reap() -> None:
    """Collect every exited child (adopted orphans included) without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(group: Path | None, *, deadline_s: float = KILL_DEADLINE_S) -> list[int]:
    """Kill every descendant of this process (and every member of ``group``) until none is left;
    returns the pids that were still alive at the deadline (empty on success)."""
    me = os.getpid()
    stop_at = time.monotonic() + deadline_s
    left: list[int] = []
    while True:
        if group is not None:
            _kill_cgroup(group)
        left = [p for p in descendants(me) if p != me]
        if group is not None:
            left += [p for p in _cgroup_pids(group) if p != me and p not in left]
        for pid in left:
            _kill(pid)
        _reap()
        if not left or time.monotonic() > stop_at:
            break
        time.sleep(0.01)
    if group is not None:
        with contextlib.suppress(OSError):
            group.rmdir()
    return left


def supervise(command: Sequence[str]) -> int:
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stop)
    set_subreaper()
    group = new_cgroup()
    status = 128 + signal.SIGTERM
    try:
        child = subprocess.Popen(
            list(command), preexec_fn=(lambda: _join(group)) if group is not None else None
        )
        returncode = child.wait()
        status = returncode if returncode >= 0 else 128 - returncode
    except _Stop as stop:
        status = 128 + stop.signum
    finally:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)  # the cleanup below is not interrupted
        survivors = kill_tree(group)
        if survivors:
            print(f"miles ci: processes {survivors} survived SIGKILL", file=sys.stderr)
    return status


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m miles_core.ci.proctree -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    return supervise(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
