"""The ``unshare`` tool of namespace sandboxes: the kernel's ``unshare(2)`` and ``pivot_root(2)``
called directly, in a child of the supervisor -- nothing to install beyond the kernel.

:func:`start_unshare` forks a *keeper*, which creates the namespaces and forks the sandbox's
init (pid 1 of the new pid namespace). The init builds the root filesystem of
:func:`~miles_core.sandbox.local.namespaces.build_layout` on a tmpfs, pivots into it, becomes the
sandbox user and execs the reaper shell; the keeper waits for it and ends as it did. Both report
to the supervisor through a pipe (:func:`read_unshare_report`).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from miles_core.sandbox.local.namespaces import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    DEV_NODES,
    LIBC,
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    REAPER,
    SANDBOX_GID,
    SANDBOX_PATH,
    SANDBOX_UID,
    WORKDIR,
    Layout,
    bring_loopback_up,
    check,
    close_fds_above_stdio,
    devnull_stdio,
    die_with,
    join_cgroup,
    mount,
    pivot_root,
    prctl,
    tool_path,
    wait_and_exit_like,
)

MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
#: statvfs f_flag bits -> the mount flags a read-only remount must keep (the kernel refuses to
#: clear locked ones)
_KEPT_FLAGS = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _map_self(uid: int, gid: int) -> None:
    """Map the calling process's host ``uid``/``gid`` to the sandbox user in its new user namespace."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{SANDBOX_UID} {uid} 1\n")
    _write("/proc/self/gid_map", f"{SANDBOX_GID} {gid} 1\n")


def _kept_flags(path: str) -> int:
    flags = MS_NOSUID | MS_NODEV
    info = os.statvfs(path)
    for bit, flag in _KEPT_FLAGS.items():
        if info.f_flag & bit:
            flags |= flag
    return flags


def _make_target(path: str, *, directory: bool) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if directory:
        os.makedirs(path, mode=0o755, exist_ok=True)
    elif not os.path.lexists(path):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))


def _bind(source: str, target: str, *, writable: bool, keep_dev: bool = False) -> None:
    _make_target(target, directory=os.path.isdir(source))
    mount(source, target, None, MS_BIND)
    flags = _kept_flags(source) | (0 if writable else MS_RDONLY)
    if keep_dev:
        flags &= ~MS_NODEV
    mount(None, target, None, MS_REMOUNT | MS_BIND | flags)


def _tmpfs(target: str, size_mb: int, mode: str) -> None:
    os.makedirs(target, mode=0o755, exist_ok=True)
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},size={size_mb}m")


def _build_root(layout: Layout, root: str) -> None:
    """Populate ``root`` (a fresh tmpfs) with the layout; called as pid 1 of the new namespaces."""
    for directory in layout.dirs:
        os.makedirs(root + directory, mode=0o755, exist_ok=True)
    for bind in layout.binds:
        _bind(bind.source, root + bind.dest, writable=bind.writable)
    for path, target in layout.symlinks:
        os.makedirs(os.path.dirname(root + path), mode=0o755, exist_ok=True)
        os.symlink(target, root + path)
    for path, content in layout.files:
        with open(root + path, "wb") as fh:
            fh.write(content)
    os.makedirs(root + "/proc", mode=0o555)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _tmpfs(root + "/dev", 1, "0755")
    for node in DEV_NODES:
        _bind(f"/dev/{node}", f"{root}/dev/{node}", writable=True, keep_dev=True)
    links = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}  # fmt: skip
    for name, target in links.items():
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(f"{root}/dev/pts", mode=0o755)
    try:
        mount("devpts", f"{root}/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    except OSError:
        pass  # no pseudo-terminals in this sandbox; everything else works without them
    _tmpfs(f"{root}/dev/shm", layout.tmpfs_mb, "1777")
    _tmpfs(f"{root}/tmp", layout.tmpfs_mb, "1777")
    _tmpfs(f"{root}/var/tmp", layout.tmpfs_mb, "1777")






def _reset_signals() -> None:
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)




def _exec_reaper(sh: str) -> None:
    os.execve(sh, ["sh", "-c", REAPER], {"PATH": SANDBOX_PATH})




def unshare_child(
    layout: Layout, staging: str, uid: int, gid: int, report: int, parent: int, sh: str, cgroup_procs: int | None
) -> None:
    """The forked child of :func:`start_unshare` (never returns).

    As root, every namespace but the user one is created owned by the host's user namespace
    (mounts need the host paths root can read), then the init switches to the sandbox's uid and
    a user namespace of its own. Unprivileged, the user namespace comes first and owns the rest.
    """
    try:
        _reset_signals()
        die_with(parent)
        join_cgroup(cgroup_procs)
        root = os.geteuid() == 0
        others = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
        if not layout.network:
            others |= CLONE_NEWNET
        if root:
            check(LIBC.unshare(others), "unshare")
        else:
            check(LIBC.unshare(CLONE_NEWUSER | others), "unshare")
            _map_self(uid, gid)
        init = os.fork()
        if init == 0:
            _unshare_init(layout, staging, uid, gid, report, sh, root)
        os.write(report, json.dumps({"init": init}).encode() + b"\n")
        os.close(report)
        if root:  # the keeper holds nothing the sandbox could use; it needs no privileges
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            die_with(parent)  # changing credentials cleared the parent-death signal
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        devnull_stdio()
        close_fds_above_stdio()
        wait_and_exit_like(init)  # reap the init when it ends, so no zombie outlives the sandbox
    except BaseException as exc:  # reported to the supervisor, which raises it
        try:
            os.write(report, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
        finally:
            os._exit(1)


def _unshare_init(
    layout: Layout, staging: str, uid: int, gid: int, report: int, sh: str, root_owned: bool
) -> None:
    try:
        keeper = os.getppid()
        die_with(keeper)
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mount("tmpfs", staging, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")
        _build_root(layout, staging)
        check(LIBC.sethostname(layout.hostname.encode(), len(layout.hostname)), "sethostname")
        if not layout.network:
            bring_loopback_up()
        os.chdir(staging)
        pivot_root(".", ".")
        check(LIBC.umount2(b".", MNT_DETACH), "umount old root")
        os.chdir("/")
        mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        if root_owned:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            die_with(keeper)  # changing credentials cleared the parent-death signal
            prctl(PR_SET_DUMPABLE, 1)  # /proc/self/*_map stay writable by the new uid
            check(LIBC.unshare(CLONE_NEWUSER), "unshare user namespace")
            _map_self(uid, gid)
        else:
            os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
            os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        os.write(report, json.dumps({"ready": True}).encode() + b"\n")
        os.close(report)
        devnull_stdio()
        close_fds_above_stdio()
        os.chdir(WORKDIR)
        _exec_reaper(sh)
    except BaseException as exc:
        try:
            os.write(report, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
        finally:
            os._exit(1)


def start_unshare(
    layout: Layout, staging: Path, uid: int, gid: int, cgroup_procs: int | None = None
) -> tuple[int, int]:
    """Fork the keeper whose child becomes the sandbox's init; returns ``(keeper pid, read fd)``.

    ``staging`` is an empty host directory the new root is mounted on (in the sandbox's own
    mount namespace only) before it becomes the sandbox's ``/``.

    The supervisor reads JSON lines from the fd until EOF (:func:`read_report`): ``init`` (the
    init's host pid), then ``ready`` or ``error``.
    """
    sh = tool_path("sh")
    read, write = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read)
        unshare_child(layout, str(staging), uid, gid, write, parent, sh, cgroup_procs)
    os.close(write)
    return pid, read


def read_unshare_report(data: bytes) -> dict[str, Any]:
    """``{"init": pid, "ready": True}`` or ``{"error": ...}`` from :func:`start_unshare`'s report."""
    out: dict[str, Any] = {}
    for line in data.decode(errors="replace").splitlines():
        if line.strip():
            out.update(json.loads(line))
    return out
