"""OS primitives of the local provider's ``process`` isolation: rlimits, network namespaces,
per-sandbox users (the ``namespaces`` isolation is :mod:`miles_core.sandbox.local.namespaces`).

Everything here is what the host permits, probed rather than assumed:

* **Resource limits** (``setrlimit`` in the child before ``exec``): CPU seconds, address
  space, file size, open files, and the process count -- the latter only counts per user, so it
  isolates one sandbox only when the sandbox has a user of its own (below).
* **Per-sandbox users.** Running as root, each sandbox gets a uid of its own
  (:mod:`miles_core.sandbox.local.uids`): its files are private, ``RLIMIT_NPROC`` caps that sandbox alone, and
  destroying it kills *every* process of that uid (``kill(-1)`` run as the uid), including
  daemons that left the process group.
* **Network isolation** (``CLONE_NEWNET``, needs ``CAP_SYS_ADMIN``): one namespace per sandbox
  holding only an ``lo`` that is up, so the sandbox's commands reach each other on loopback and
  nothing else.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from functools import cache

from miles_core.sandbox.base import Limits
from miles_core.sandbox.local.namespaces import CLONE_NEWNET, bring_loopback_up

MB = 1 << 20
#: variable set in every sandboxed process's environment (found again by destroy)
MARKER_VAR = "MILES_SANDBOX_ID"


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def is_root() -> bool:
    return os.geteuid() == 0


def new_network_namespace() -> int:
    """A new network namespace with ``lo`` up, held by the returned fd.

    The calling thread enters the namespace, brings ``lo`` up and returns to its own; call it
    from a single-threaded process (the supervisor).
    """
    libc = _libc()
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
        try:
            bring_loopback_up()
            return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back to the host network namespace: {os.strerror(err)}")
    finally:
        os.close(home)


@cache
def network_isolation_available() -> bool:
    """Whether this process may create network namespaces (probed in a child process)."""
    probe = "import ctypes,sys; sys.exit(0 if ctypes.CDLL(None).unshare(0x40000000) == 0 else 1)"
    try:
        return (
            subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, timeout=10).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def rlimits(
    limits: Limits, *, processes: bool | None = None, address_space: bool = True
) -> list[tuple[int, int]]:
    """``(resource, value)`` pairs that enforce ``limits`` (hard = soft).

    ``processes``: whether to set ``RLIMIT_NPROC``, which counts per user (per user namespace
    since Linux 5.14); default: when running as root, where each sandbox has a uid of its own.
    ``address_space``: whether ``RLIMIT_AS`` enforces ``memory_mb`` (not when a cgroup does).
    """
    pairs = [
        (resource.RLIMIT_CPU, limits.cpu_seconds),
        (resource.RLIMIT_FSIZE, limits.file_size_mb * MB),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_CORE, 0),
    ]
    if address_space:
        pairs.append((resource.RLIMIT_AS, limits.memory_mb * MB))
    if is_root() if processes is None else processes:
        pairs.append((resource.RLIMIT_NPROC, limits.processes))
    return pairs


def child_setup(limits: list[tuple[int, int]], uid: int | None, netns_fd: int | None) -> Callable[[], None]:
    """The ``preexec_fn`` of every sandboxed process: namespace, limits, then drop to ``uid``.

    Order matters: entering a namespace needs privileges the uid drop removes.
    """
    setns = _libc().setns if netns_fd is not None else None

    def setup() -> None:
        if setns is not None and setns(netns_fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET) failed")
        for which, value in limits:
            resource.setrlimit(which, (value, value))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        os.umask(0o077)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the supervisor ignores it; commands must not

    return setup


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` at once: ``kill(-1, SIGKILL)`` from a child running *as*
    that uid.

    ``kill(-1)`` reaches every process the caller may signal, atomically with respect to forks,
    so a fork bomb cannot outrun it. The child only makes system calls; still, call this from a
    single-threaded process (the supervisor), where forking is safe.
    """
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, 9)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def sandbox_processes(sandbox_id: str) -> list[int]:
    """Pids of this user's processes whose environment carries ``MILES_SANDBOX_ID=<id>``."""
    marker, me, found = f"{MARKER_VAR}={sandbox_id}".encode(), os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if marker in fh.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return found


def kill_sandbox_processes(sandbox_id: str) -> int:
    """SIGKILL the processes of a sandbox without a uid of its own, found by their marker.

    Repeats until none is left (a dying parent may have forked meanwhile); returns the count.
    Zombies have an empty environment, so the loop ends once all were killed.
    """
    killed = 0
    for _ in range(20):
        pids = sandbox_processes(sandbox_id)
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                continue
            killed += 1
        if not pids:
            break
    return killed
