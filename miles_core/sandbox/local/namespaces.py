"""Namespace sandboxes of the local provider: each sandbox is its own user, pid, mount, network,
IPC, UTS and cgroup namespace, held by an init process.

The filesystem a sandbox sees is built from nothing: a read-only tmpfs root holding read-only
bind mounts of the host's system directories (``/usr``, ``/bin``, ``/lib*``), a short allow list
of ``/etc`` entries, generated ``/etc/passwd``/``group``/``hosts``/``hostname``, the chosen Python
interpreter, a fresh ``/proc`` of the sandbox's own pid namespace, a minimal ``/dev``, private
tmpfs ``/tmp``, ``/var/tmp`` and ``/dev/shm``, and the sandbox's working directory at
:data:`WORKDIR` (the only writable host directory). Nothing else of the host is visible.

Two tools build it, chosen by :func:`support`:

* ``bwrap`` (bubblewrap, where installed; :mod:`.ns_bwrap`): the sandbox is one ``bwrap`` process tree.
* ``unshare`` (:mod:`.ns_unshare`): the same namespaces set up with the kernel's ``unshare(2)``/``pivot_root(2)``
  directly, in a child of the supervisor (needs no tool besides the kernel).

Either way the init is ``/bin/sh`` as pid 1 of the sandbox, reaping orphans; pid 1 ignores
signals from inside, so nothing in the sandbox can end it. Every command is started by the
supervisor entering the init's namespaces through a pidfd (:func:`entering`), as uid
:data:`SANDBOX_UID` with no capabilities and ``no_new_privs``. Destroying a sandbox kills its
init, which makes the kernel kill every process of the pid namespace: nothing survives it.

Credentials: the sandbox's processes are, on the host, the uid the supervisor gives them -- a
uid of its own per sandbox when running as root, the owner's own uid otherwise (an unprivileged
process can map only itself). Running as root the namespaces other than the user namespace are
owned by the host's user namespace, so the sandbox cannot change its mounts even in principle.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
#: what ends a command in a sandbox: sent to its waiter, which SIGKILLs the command's group
END_COMMAND = signal.SIGTERM
#: pivot_root(2) has no libc wrapper
_SYS_PIVOT_ROOT = {"x86_64": 155, "i686": 217, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

SANDBOX_UID = SANDBOX_GID = 1000
SANDBOX_USER = "sandbox"
HOSTNAME = "sandbox"
WORKDIR = "/home/sandbox"
#: holds ``python`` and ``python3`` (the chosen interpreter), first on the sandbox's PATH
BIN_DIR = "/run/miles/bin"
SANDBOX_PATH = f"{BIN_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: the /etc entries a sandbox sees (what dynamic linking, TLS and Python need); everything else
#: of the host's /etc (users, hostname, machine id, host configuration) stays out
ETC_ALLOW = (
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "crypto-policies",
    "gai.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "mime.types",
    "pki",
    "protocols",
    "services",
    "ssl",
    "timezone",
)
REAPER = "trap '' HUP INT QUIT TERM USR1 USR2 PIPE; while :; do sleep 2147483647 & wait; done"
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
SUPPORT_TIMEOUT_S = 20


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


LIBC = _libc()


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(
        LIBC.mount(
            source.encode() if source is not None else None,
            target.encode(),
            fstype.encode() if fstype is not None else None,
            flags,
            data.encode() if data is not None else None,
        ),
        f"mount {source or fstype} on {target}",
    )


def prctl(option: int, arg: int = 0) -> None:
    check(LIBC.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def setns(fd: int, flags: int) -> None:
    check(LIBC.setns(fd, flags), "setns")


def pivot_root(new_root: str, put_old: str) -> None:
    number = _SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown system call number on {platform.machine()}")
    check(LIBC.syscall(number, new_root.encode(), put_old.encode()), "pivot_root")


def bring_loopback_up() -> None:
    """Set ``lo`` up in the calling thread's network namespace."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def kernel_counts_processes_per_userns() -> bool:
    """RLIMIT_NPROC counts per user namespace since Linux 5.14 (ucounts), so in a sandbox of its
    own the limit caps that sandbox, whoever else runs as the same host uid."""
    numbers = platform.release().split("-")[0].split(".")
    try:
        major, minor = int(numbers[0]), int(numbers[1])
    except (IndexError, ValueError):
        return False
    return (major, minor) >= (5, 14)


# -- what a sandbox sees ----------------------------------------------------------------------


@dataclass(frozen=True)
class Bind:
    """A host path bound at ``dest`` inside the sandbox (read-only unless ``writable``)."""

    source: str
    dest: str
    writable: bool = False


@dataclass(frozen=True)
class Interpreter:
    """The Python a sandbox's ``python``/``python3`` run: its executable and what it needs bound."""

    executable: str
    version: str
    origin: str  # "caller" (the owner's own interpreter) or "host" (the host's python3)
    prefixes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"python": self.executable, "version": self.version, "origin": self.origin}


@dataclass(frozen=True)
class Layout:
    binds: tuple[Bind, ...]
    symlinks: tuple[tuple[str, str], ...]  # (path in the sandbox, link target)
    files: tuple[tuple[str, bytes], ...]  # generated (path in the sandbox, content)
    tmpfs_mb: int
    network: bool
    hostname: str = HOSTNAME
    dirs: tuple[str, ...] = field(default=())


def _others_may_use(path: str, *, execute: bool) -> bool:
    """Whether a uid that is neither owner nor group of anything on ``path`` can reach it."""
    try:
        target = os.stat(path)
    except OSError:
        return False
    needed = stat.S_IXOTH if execute else stat.S_IROTH
    if not target.st_mode & needed:
        return False
    return all(os.stat(ancestor).st_mode & stat.S_IXOTH for ancestor in Path(path).parents)


def _version(executable: str) -> str:
    if os.path.realpath(executable) == os.path.realpath(sys.executable):
        return platform.python_version()
    try:
        done = subprocess.run(
            [executable, "-S", "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            timeout=10,
            env={"PATH": "/usr/bin:/bin"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.decode().strip() or "unknown"


@cache
def interpreter(foreign_uid: bool) -> Interpreter | None:
    """The Python a sandbox gets: the caller's own (this process's interpreter, its venv
    included) when the sandbox's uid may run it, else the host's ``python3``, else none.

    ``foreign_uid``: the sandbox runs as another host uid than this process (root gives each
    sandbox a uid of its own), so only what every uid may read is usable.
    """
    executable = sys.executable
    prefixes = tuple(dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)))
    usable = bool(executable) and (
        not foreign_uid
        or (
            _others_may_use(os.path.realpath(executable), execute=True)
            and all(_others_may_use(p, execute=True) for p in prefixes)
        )
    )
    if usable:
        return Interpreter(executable, platform.python_version(), "caller", prefixes)
    host = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if host is None:
        return None
    return Interpreter(host, _version(host), "host", ())


def _generated_etc() -> tuple[tuple[str, bytes], ...]:
    passwd = (
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_GID}:{SANDBOX_USER}:{WORKDIR}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    group = f"root:x:0:\n{SANDBOX_USER}:x:{SANDBOX_GID}:\nnogroup:x:65534:\n"
    hosts = f"127.0.0.1\tlocalhost {HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    return (
        ("/etc/passwd", passwd.encode()),
        ("/etc/group", group.encode()),
        ("/etc/hosts", hosts.encode()),
        ("/etc/hostname", f"{HOSTNAME}\n".encode()),
        ("/etc/nsswitch.conf", b"passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n"),
    )


def build_layout(
    workdir: Path, *, network: bool, python: Interpreter | None, tmpfs_mb: int
) -> Layout:
    """What the sandbox with working directory ``workdir`` sees (see the module doc)."""
    binds: list[Bind] = []
    symlinks: list[tuple[str, str]] = []
    for name in SYSTEM_DIRS:
        path = f"/{name}"
        if os.path.islink(path):
            symlinks.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            binds.append(Bind(path, path))
    etc = list(ETC_ALLOW) + (["resolv.conf"] if network else [])
    for name in etc:
        path = f"/etc/{name}"
        if os.path.islink(path):
            target = os.readlink(path)
            resolved = os.path.realpath(path)
            if resolved.startswith("/usr/") and os.path.exists(resolved):
                symlinks.append((path, target))  # /etc/localtime -> /usr/share/zoneinfo/...
            elif os.path.exists(resolved):
                binds.append(Bind(resolved, path))
        elif os.path.exists(path):
            binds.append(Bind(path, path))
    if python is not None:
        for prefix in python.prefixes:
            if not any(prefix == b.dest or prefix.startswith(b.dest + "/") for b in binds):
                binds.append(Bind(prefix, prefix))
        symlinks.append((f"{BIN_DIR}/python3", python.executable))
        symlinks.append((f"{BIN_DIR}/python", python.executable))
    binds.append(Bind(str(workdir), WORKDIR, writable=True))
    return Layout(
        binds=tuple(binds),
        symlinks=tuple(symlinks),
        files=_generated_etc(),
        tmpfs_mb=tmpfs_mb,
        network=network,
        dirs=("/etc", BIN_DIR, "/var", "/home"),
    )


# -- processes of a sandbox ----------------------------------------------------------------------


def devnull_stdio() -> None:
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)


def close_fds_above_stdio() -> None:
    os.closerange(3, 1 << 20)


def die_with(parent: int) -> None:
    """Get SIGKILL when ``parent`` dies -- or now, if it already has."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def join_cgroup(procs_fd: int | None) -> None:
    """Move the calling process into a sandbox's cgroup (its children follow)."""
    if procs_fd is not None:
        os.write(procs_fd, b"0")


# -- entering a sandbox -----------------------------------------------------------------------------


def entering(
    pidfd: int,
    *,
    root_owned: bool,
    cwd: str,
    rlimits: Sequence[tuple[int, int]],
    cgroup_procs: int | None = None,
    end_group_on_exit: bool = True,
) -> Callable[[], None]:
    """The ``preexec_fn`` that moves a new process into the sandbox held by ``pidfd``.

    It joins the sandbox's cgroup (when it has one) and the init's namespaces, sets the limits, drops every capability and privilege
    (uid :data:`SANDBOX_UID`, empty bounding set, ``no_new_privs``), then forks: the command
    runs in the child, inside the sandbox's pid namespace, leading a process group of its own;
    this process stays outside as its *waiter* (:func:`wait_for_command`), holding no file
    descriptor. To end the command, send the waiter :data:`END_COMMAND`, never SIGKILL.
    ``end_group_on_exit``: when the command exits, kill what it started that stayed in its
    process group (a foreground command); not for a background one.
    """
    import resource

    def setup() -> None:
        join_cgroup(cgroup_procs)
        if os.geteuid() == 0:
            os.setgroups([])
        others = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP | CLONE_NEWNET
        if root_owned:  # namespaces owned by the host's: join them before the sandbox's user ns
            setns(pidfd, others)
            setns(pidfd, CLONE_NEWUSER)
        else:
            setns(pidfd, CLONE_NEWUSER | others)
        os.chdir(cwd)
        for which, value in rlimits:
            resource.setrlimit(which, (value, value))
        for cap in range(64):
            if LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
                break  # past the last capability this kernel knows
        os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
        os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        os.umask(0o022)  # files stay private to the sandbox: nothing else sees its filesystem
        child = os.fork()
        if child == 0:
            os.setpgid(0, 0)
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the supervisor ignores it; commands must not
            os.close(pidfd)
            return  # subprocess closes the remaining descriptors and execs the command
        wait_for_command(child, end_group_on_exit=end_group_on_exit)

    return setup


def wait_for_command(child: int, *, end_group_on_exit: bool) -> None:
    """The waiting half of :func:`entering`: SIGKILL the command's process group on
    :data:`END_COMMAND`, reap the command, end exactly as it did.

    The waiter must outlive the command. The command is in the sandbox's pid namespace but its
    parent is not: were the waiter killed first, the kernel would hand the command to the
    reaper of the *waiter's* namespace -- the host's init -- and the sandbox's init cannot finish
    exiting (nor a destroy waiting for it) until the host's init has reaped that zombie: seconds
    on a loaded host, never under an init that does not reap.
    """
    try:
        try:  # also in the child (whichever runs first): the group must exist before a request can come
            os.setpgid(child, child)
        except (PermissionError, ProcessLookupError):
            pass  # it has exec'd or ended: it set its group itself first
        # the command stays unreaped (a zombie at worst) while the handler may run, so its
        # group id cannot have been reused by another process
        signal.set_wakeup_fd(-1)  # the supervisor's event loop's, about to be closed
        signal.signal(END_COMMAND, lambda _signum, _frame: os.killpg(child, signal.SIGKILL))
        for fd in (0, 1, 2):
            os.close(fd)
        close_fds_above_stdio()
        os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
        signal.pthread_sigmask(signal.SIG_BLOCK, {END_COMMAND})
        if end_group_on_exit:
            os.killpg(child, signal.SIGKILL)
        exit_like(child)
    finally:
        os._exit(255)


def wait_and_exit_like(child: int) -> None:
    """Close every descriptor, wait for ``child``, then end exactly as it did."""
    try:
        for fd in (0, 1, 2):
            os.close(fd)
        close_fds_above_stdio()
        exit_like(child)
    finally:
        os._exit(255)


def exit_like(child: int) -> None:
    """Reap ``child`` and end exactly as it did (code or signal); never returns."""
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {number})
        os.kill(os.getpid(), number)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


# -- what the host supports ---------------------------------------------------------------------------


@cache
def tool_path(name: str) -> str:
    """Absolute path of a host tool the sandboxes use (``sh``, ``sleep``, ``bwrap``)."""
    found = shutil.which(name, path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        raise FileNotFoundError(f"{name} is not installed on this host")
    return found


@dataclass(frozen=True)
class Support:
    """What :func:`support` found: whether namespace sandboxes work here, and with which tool."""

    available: bool
    tool: str | None  # "bwrap" or "unshare"
    detail: str  # the tool's version, or why namespaces are unavailable
    tools: dict[str, str] = field(default_factory=dict)  # tool -> "ok" or why it failed

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "tool": self.tool, "detail": self.detail, "tools": dict(self.tools)}


def _bwrap_version(bwrap: str) -> str:
    done = subprocess.run([bwrap, "--version"], capture_output=True, timeout=10, env={"PATH": "/usr/bin:/bin"})
    return done.stdout.decode().strip() or "bwrap"


@cache
def support(tool: str = "auto") -> Support:
    """Probe the host once per process: start a real sandbox with each candidate tool (in a
    child process: this one may be multi-threaded) and check it from inside.

    ``tool``: ``auto`` (bwrap if it works, else unshare), ``bwrap`` or ``unshare``.
    """
    candidates = ("bwrap", "unshare") if tool == "auto" else (tool,)
    results: dict[str, str] = {}
    for name in candidates:
        if name == "bwrap" and shutil.which("bwrap", path="/usr/local/bin:/usr/bin:/bin") is None:
            results[name] = "bwrap is not installed (apt-get install bubblewrap)"
            continue
        try:
            done = subprocess.run(
                [sys.executable, "-m", "miles_core.sandbox.local.namespaces", name],
                capture_output=True,
                timeout=SUPPORT_TIMEOUT_S,
                env={"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            results[name] = f"probe failed: {exc}"
            continue
        if done.returncode == 0:
            results[name] = "ok"
            detail = _bwrap_version(tool_path("bwrap")) if name == "bwrap" else "unshare(2), pivot_root(2)"
            return Support(True, name, detail, results)
        lines = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()
        results[name] = lines[-1] if lines else f"probe exited {done.returncode}"
    why = "; ".join(f"{name}: {reason}" for name, reason in results.items())
    return Support(False, None, why, results)


def _probe_main(tool: str) -> int:
    """Start one sandbox with ``tool`` in a scratch directory and run ``true`` in it."""
    import tempfile
    import time

    from miles_core.sandbox.base import Limits
    from miles_core.sandbox.local.isolation import rlimits

    with tempfile.TemporaryDirectory(prefix="miles-ns-probe-") as scratch:
        workdir = Path(scratch) / "work"
        workdir.mkdir()
        uid, gid = os.geteuid(), os.getegid()
        if uid == 0:  # probe what sandboxes get: an unprivileged uid of their own
            uid = gid = 1_899_999
            os.chmod(scratch, 0o711)
            os.chown(workdir, uid, gid)
        layout = build_layout(workdir, network=False, python=None, tmpfs_mb=1)
        if tool == "bwrap":
            from miles_core.sandbox.local.ns_bwrap import parse_bwrap_report, start_bwrap

            log = os.open(os.path.join(scratch, "bwrap.log"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            proc, report = start_bwrap(tool_path("bwrap"), layout, uid, gid, log)
            os.close(log)
            keeper = proc.pid
        else:
            from miles_core.sandbox.local.ns_unshare import read_unshare_report, start_unshare

            staging = Path(scratch) / "root"
            staging.mkdir()
            keeper, report = start_unshare(layout, staging, uid, gid)
            proc = None
        data = b""
        parse = parse_bwrap_report if tool == "bwrap" else read_unshare_report
        info = parse(data)
        deadline = time.monotonic() + SUPPORT_TIMEOUT_S / 2
        while not report_complete(info) and time.monotonic() < deadline:
            chunk = os.read(report, 4096)
            if not chunk:
                break
            data += chunk
            info = parse(data)
        os.close(report)
        try:
            if "error" in info or not info.get("ready"):
                logged = Path(scratch, "bwrap.log").read_text().strip() if tool == "bwrap" else ""
                print(info.get("error") or logged or "the sandbox did not start", file=sys.stderr)
                return 1
            pidfd = os.pidfd_open(info["init"])
            done = subprocess.run(
                ["/bin/sh", "-c", "test $$ -gt 1 && test ! -e /etc/machine-id && touch /tmp/x && ! touch /x"],
                preexec_fn=entering(pidfd, root_owned=os.geteuid() == 0 and tool == "unshare", cwd=WORKDIR,
                                    rlimits=rlimits(Limits())),
                pass_fds=(pidfd,), capture_output=True, env={"PATH": SANDBOX_PATH}, timeout=10,
            )  # fmt: skip
            if done.returncode != 0:
                print(f"a command in the sandbox failed ({done.returncode}): {done.stderr.decode()!r}", file=sys.stderr)
                return 1
            return 0
        finally:
            if "init" in info:
                try:
                    os.kill(info["init"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if proc is not None:
                proc.wait()
            else:  # the keeper ends by itself once it has reaped the init: killed first, it would
                # hand the init's zombie to the host's init
                if "init" not in info:
                    os.kill(keeper, signal.SIGKILL)
                os.waitpid(keeper, 0)


def report_complete(info: dict[str, Any]) -> bool:
    """A starting sandbox's report says all it will: it failed, or it is ready and named its init
    (the keeper and the init write independently: either line may come first)."""
    return "error" in info or (bool(info.get("ready")) and "init" in info)


if __name__ == "__main__":
    sys.exit(_probe_main(sys.argv[1]))
