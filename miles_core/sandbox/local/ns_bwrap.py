"""The ``bwrap`` tool of namespace sandboxes: bubblewrap builds the sandbox of
:func:`~miles_core.sandbox.local.namespaces.build_layout` as one process tree, run as the
sandbox's host uid; its init is the same reaper shell as the unshare tool's (``--as-pid-1``).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
from typing import Any

from miles_core.sandbox.local.namespaces import (
    PR_SET_PDEATHSIG,
    REAPER,
    SANDBOX_GID,
    SANDBOX_PATH,
    SANDBOX_UID,
    WORKDIR,
    Layout,
    join_cgroup,
    prctl,
)

#: descriptors of a bwrap child: its --info-fd, the init's ready signal, then the generated files
BWRAP_INFO_FD, BWRAP_READY_FD, BWRAP_DATA_FD = 3, 4, 5
READY_WORD = "miles-sandbox-ready"


def bwrap_argv(bwrap: str, layout: Layout) -> list[str]:
    """The bwrap command line of a sandbox (descriptors as in :func:`start_bwrap`)."""
    argv = [
        bwrap,
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID), "--hostname", layout.hostname,
        "--die-with-parent", "--disable-userns", "--as-pid-1", "--cap-drop", "ALL", "--clearenv",
    ]  # fmt: skip
    if not layout.network:
        argv.append("--unshare-net")
    for directory in layout.dirs:
        argv += ["--dir", directory]
    for bind in layout.binds:
        argv += ["--bind" if bind.writable else "--ro-bind", bind.source, bind.dest]
    for path, target in layout.symlinks:
        argv += ["--symlink", target, path]
    for index, (path, _) in enumerate(layout.files):
        argv += ["--perms", "0644", "--ro-bind-data", str(BWRAP_DATA_FD + index), path]
    size = str(layout.tmpfs_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        argv += ["--perms", "1777", "--size", size, "--tmpfs", path]
    argv += ["--remount-ro", "/", "--chdir", WORKDIR, "--info-fd", str(BWRAP_INFO_FD)]
    argv += ["--setenv", "PATH", SANDBOX_PATH, "--", "/bin/sh", "-c"]
    ready = BWRAP_READY_FD
    argv.append(f"echo {READY_WORD} >&{ready}; exec </dev/null >/dev/null 2>&1 {ready}>&-; {REAPER}")
    return argv


def start_bwrap(
    bwrap: str, layout: Layout, uid: int, gid: int, log_fd: int, cgroup_procs: int | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """Start bwrap as the sandbox's host uid; returns the process and the report fd.

    The report fd yields bwrap's ``--info-fd`` JSON (the init's pid), then one newline from the
    init (:data:`READY_WORD`) once the sandbox is fully set up (bwrap finishes its setup before it execs the init).
    bwrap's own errors go to ``log_fd``. The child's descriptors are set in ``preexec_fn``
    (``close_fds=False``: every other descriptor of the supervisor is close-on-exec), at fixed
    low numbers the init's shell can close.
    """
    if len(layout.files) > 10 - BWRAP_DATA_FD:
        raise ValueError("too many generated files for the bwrap descriptor layout")
    read, write = os.pipe()
    data_fds = []
    try:
        for _, content in layout.files:
            data_read, data_write = os.pipe()
            os.write(data_write, content)
            os.close(data_write)
            data_fds.append(data_read)
        wanted = [write, write, *data_fds]  # info, ready, data
        root = os.geteuid() == 0

        def child_setup() -> None:
            join_cgroup(cgroup_procs)
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in wanted]
            for number, fd in enumerate(high, start=BWRAP_INFO_FD):
                os.dup2(fd, number, inheritable=True)
            if root:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

        proc = subprocess.Popen(
            bwrap_argv(bwrap, layout),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_fd,
            close_fds=False,
            preexec_fn=child_setup,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
        )
    finally:
        os.close(write)
        for fd in data_fds:
            os.close(fd)
    return proc, read


def parse_bwrap_report(data: bytes) -> dict[str, Any]:
    """``{"init": pid, "ready": bool}`` from what :func:`start_bwrap`'s report fd yielded."""
    text = data.decode(errors="replace")
    end = text.find("}")
    if end < 0:
        return {"ready": False}
    info = json.loads(text[: end + 1])
    return {"init": int(info["child-pid"]), "ready": READY_WORD in text[end + 1 :]}
