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
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache

from miles_core.sandbox.base import Limits
from miles_core.sandbox.local.namespaces import CLONE_NEWNET, bring_loopback_up

MB = 1 << 20
#: variable set in every sandboxed process's environment (found again by destroy)
MARKER_VAR = "MILES_SANDBOX_ID"
#: how long a destroy waits for the processes it SIGKILLed to have exited. Exiting needs only
#: CPU time: to be scheduled, free memory (~0.4 s per GiB on 2 loaded cores), close files; a
#: namespace sandbox's init in addition until every process of its pid namespace was reaped, by
#: the init or by the commands' waiters (:func:`~miles_core.sandbox.local.namespaces.
#: wait_for_command`), which wait in ``waitid``. Measured at load 4 on 2 cores: under 20 ms per
#: sandbox. Past this, something no wait would end holds a process (stuck in the kernel, a
#: zombie whose parent never reaps); the error names it.
EXIT_TIMEOUT_S = 10.0


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


def kill_uid(uid: int, timeout: float = EXIT_TIMEOUT_S) -> None:
    """SIGKILL every process of ``uid`` at once -- ``kill(-1, SIGKILL)`` from a child running
    *as* that uid -- then wait until each has exited (:func:`wait_exited`).

    ``kill(-1)`` reaches every process the caller may signal (real or saved uid ``uid``),
    atomically with respect to forks, so a fork bomb cannot outrun it, and none of ``uid`` can
    appear afterwards. The child only makes system calls; still, call this from a
    single-threaded process (the supervisor), where forking is safe.
    """
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, 9)
            os._exit(0)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise OSError(f"could not kill the processes of uid {uid} (killer exit status {status})")
    wait_exited(_pidfds_of_uid(uid), timeout)


def _status_uids(pid: int) -> list[bytes]:
    """Real, effective, saved and filesystem uid of ``pid`` (empty if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Uid:"):
                    return line.split()[1:]
    except OSError:
        pass  # gone
    return []


def _pidfds_of_uid(uid: int) -> dict[int, int]:
    """``{pidfd: pid}`` of the processes whose real or saved uid is ``uid`` (what ``kill(-1)``
    as ``uid`` reaches)."""
    wanted, found = str(uid).encode(), {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or wanted not in _status_uids(int(entry.name))[::2]:
            continue
        try:
            pidfd = os.pidfd_open(int(entry.name))
        except ProcessLookupError:
            continue
        # read again through the open pidfd's pid: it is that process's now, not a recycled one's
        if wanted in _status_uids(int(entry.name))[::2]:
            found[pidfd] = int(entry.name)
        else:
            os.close(pidfd)
    return found


def wait_exited(pidfds: dict[int, int], timeout: float = EXIT_TIMEOUT_S) -> None:
    """Wait until every process of ``{pidfd: pid}`` has exited, then close the pidfds.

    Killed is not exited: a SIGKILLed process still has to be scheduled, free its memory and
    close its files (a few hundred milliseconds per GiB it held). Exited is what a destroy
    promises: a zombie has, only its parent has not reaped it yet -- that parent may be the
    host's init, whose pace is not ours to wait for."""
    poller = select.poll()
    for pidfd in pidfds:
        poller.register(pidfd, select.POLLIN)
    left = dict(pidfds)
    deadline = time.monotonic() + timeout
    try:
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"processes {sorted(left.values())} did not exit {timeout:g}s after SIGKILL")
            for pidfd, _ in poller.poll(remaining * 1000):
                poller.unregister(pidfd)
                del left[pidfd]
    finally:
        for pidfd in pidfds:
            os.close(pidfd)


def _environ(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read()
    except OSError:  # exited meanwhile, or not ours to read
        return None


def sandbox_processes(sandbox_id: str) -> list[int]:
    """Pids of this user's processes whose environment carries ``MILES_SANDBOX_ID=<id>``."""
    marker, me, found = f"{MARKER_VAR}={sandbox_id}".encode(), os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        environ = _environ(int(entry.name))
        if environ is not None and marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_sandbox_processes(sandbox_id: str, timeout: float = EXIT_TIMEOUT_S) -> int:
    """SIGKILL the processes of a sandbox without a uid of its own, found by their marker, then
    wait until each has exited (:func:`wait_exited`); returns how many were killed.

    Repeats until a pass finds none (a dying parent may have forked meanwhile). A killed process
    that is still exiting keeps its environment until it has freed its memory; it is killed
    once. Zombies have an empty environment.
    """
    marker = f"{MARKER_VAR}={sandbox_id}".encode()
    killed: dict[int, int] = {}
    try:
        for _ in range(20):
            fresh = [pid for pid in sandbox_processes(sandbox_id) if pid not in killed.values()]
            for pid in fresh:
                try:
                    pidfd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue
                environ = _environ(pid)  # through the open pidfd's pid: not a recycled one's
                if environ is None or marker not in environ.split(b"\0"):
                    os.close(pidfd)
                    continue
                killed[pidfd] = pid
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # exited meanwhile: waiting for it returns at once
            if not fresh:
                break
    except BaseException:
        for pidfd in killed:
            os.close(pidfd)
        raise
    wait_exited(killed, timeout)
    return len(killed)
