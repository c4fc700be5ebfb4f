"""Hostile probes: what model-written code tries, run inside a provider's sandboxes.

Each probe runs a small POSIX-shell program in a sandbox (created with ``network=False``) and
decides from evidence -- never from an exit code alone -- whether it *escaped*:

========================  ======================================================================
``environ``               read a secret from the environment of a host process (a canary started
                          like a trainer, holding ``MILES_PROBE_SECRET``), via ``/proc/*/environ``
``signal``                signal a host process: the canary reports every signal it receives
``other_sandbox``         read files another live sandbox wrote (its workdir, ``/tmp``,
                          ``/dev/shm``, ``/var/tmp``, through ``/proc/*/cwd`` and ``root``)
``escape_destroy``        leave processes behind (``setsid env -i sleep``, ``nohup``, a double
                          fork, a background exec) that survive ``destroy``
``leftover_files``        files written to ``/tmp``, ``/dev/shm``, ``/var/tmp`` that stay on the
                          host, or are seen by the next sandbox, after ``destroy``
``fork_loop``             a bounded fork loop (64) under ``processes=16``: more than 16 started
``network``               connect to the host: TCP on loopback and on its address, and an
                          abstract unix socket
``host_processes``        see a host process's arguments in ``/proc``: the canary's marker, or
                          the owner's own command line
``host_files``            read world-readable host files: planted in ``/tmp``, ``/var/tmp`` and
                          ``/dev/shm``, or the host's ``/etc/machine-id`` and ``/etc/hostname``
========================  ======================================================================

A provider declares the probes it claims to stop in ``capabilities.isolates``; the conformance
kit fails a claimed probe that escapes. Probes that need to watch the host (processes after
destroy, files left in the host's ``/tmp``) apply to providers that run on this host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from miles_core.sandbox.base import Limits, SandboxProvider, SandboxRef, SandboxSpec

PROBES: dict[str, str] = {
    "environ": "read another process's environment",
    "signal": "signal a host process (the owner, a canary)",
    "other_sandbox": "read another sandbox's files",
    "escape_destroy": "leave processes running after destroy",
    "leftover_files": "leave files in /tmp, /dev/shm, /var/tmp after destroy",
    "fork_loop": "start more processes than the processes limit",
    "network": "reach the host over the network",
    "host_processes": "see the host's processes and their arguments",
    "host_files": "read world-readable host files",
}
FORK_LIMIT = 16
FORK_TRIES = 64
PROBE_TIMEOUT_S = 60.0
CANARY = r"""
import signal, sys, time
def got(*_):
    sys.stdout.write("signalled\n"); sys.stdout.flush()
signal.signal(signal.SIGUSR1, got)
signal.signal(signal.SIGUSR2, got)
sys.stdout.write("ready\n"); sys.stdout.flush()
end = time.monotonic() + 600
while time.monotonic() < end:
    time.sleep(0.05)
"""


@dataclass
class ProbeResult:
    name: str
    escaped: bool
    evidence: str
    observed: bool = True  # False: this host cannot watch what the probe needs (remote sandboxes)
    claimed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HostTraps:
    """What the probes look for on the host: a canary process, planted files, listeners."""

    token: str
    canary: subprocess.Popen[bytes]
    owner_pid: int
    files: list[Path] = field(default_factory=list)
    listeners: list[socket.socket] = field(default_factory=list)
    targets: list[tuple[str, int]] = field(default_factory=list)  # (host, port) the sandbox must not reach
    abstract: str = ""

    @property
    def marker(self) -> str:
        return f"miles-probe-{self.token}"

    @property
    def pattern(self) -> str:
        """A regex for :attr:`marker` that does not match itself: a ``grep`` for it in the
        sandbox must not find its own argv."""
        return f"miles-probe-[{self.token[0]}]{self.token[1:]}"

    def signalled(self) -> bool:
        """Whether the canary got a signal (read without blocking)."""
        assert self.canary.stdout is not None
        fd = self.canary.stdout.fileno()
        os.set_blocking(fd, False)
        try:
            return b"signalled" in os.read(fd, 4096)
        except BlockingIOError:
            return False


def _host_address() -> str | None:
    """This host's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@contextlib.contextmanager
def host_traps() -> Iterator[HostTraps]:
    token = secrets.token_hex(8)
    canary = subprocess.Popen(
        [sys.executable, "-S", "-c", CANARY, f"miles-probe-{token}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "MILES_PROBE_SECRET": f"secret-{token}"},
    )
    traps = HostTraps(token, canary, os.getpid())
    try:
        assert canary.stdout is not None
        if canary.stdout.readline().strip() != b"ready":
            raise RuntimeError("the probe canary did not start")
        for directory in (tempfile.gettempdir(), "/var/tmp", "/dev/shm"):
            try:
                folder = Path(tempfile.mkdtemp(prefix="miles-probe-", dir=directory))
            except OSError:
                continue
            os.chmod(folder, 0o755)
            planted = folder / "world-readable.txt"
            planted.write_text(f"planted-{token}\n")
            os.chmod(planted, 0o644)
            traps.files.append(planted)
        for host in ("127.0.0.1", _host_address()):
            if host is None:
                continue
            listener = socket.create_server((host, 0), backlog=16)
            traps.listeners.append(listener)
            traps.targets.append((host, listener.getsockname()[1]))
        traps.abstract = f"miles-probe-{token}"
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind("\0" + traps.abstract)
        unix.listen(16)
        traps.listeners.append(unix)
        yield traps
    finally:
        canary.kill()
        canary.wait()
        if canary.stdout is not None:
            canary.stdout.close()
        for listener in traps.listeners:
            listener.close()
        for planted in traps.files:
            planted.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                planted.parent.rmdir()


def _host_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _processes_with_args(needles: list[str]) -> list[str]:
    """Host processes whose argv contains one of ``needles`` as a whole argument."""
    found = []
    wanted = {n.encode() for n in needles}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted & set(args):
            found.append(f"{entry.name}: {b' '.join(args).decode(errors='replace').strip()}")
    return found


class _Run:
    """One probe's sandboxes, destroyed at the end whatever happens."""

    def __init__(self, provider: SandboxProvider, labels: Mapping[str, str]) -> None:
        self.provider = provider
        self.labels = dict(labels)
        self.refs: list[SandboxRef] = []

    async def create(self, **spec: Any) -> SandboxRef:
        ref = await self.provider.create(SandboxSpec(labels={**self.labels, "probe.box": str(len(self.refs))}, **spec))
        self.refs.append(ref)
        return ref

    async def sh(self, ref: SandboxRef, script: str, timeout: float = PROBE_TIMEOUT_S) -> str:
        result = await self.provider.exec(ref, ["/bin/sh", "-c", script], timeout=timeout)
        return result.stdout + result.stderr

    async def destroy(self, ref: SandboxRef) -> None:
        if ref in self.refs:
            self.refs.remove(ref)
        await self.provider.destroy(ref.id)

    async def close(self) -> None:
        for ref in list(self.refs):
            await self.destroy(ref)


def _found(needle: str, text: str) -> str:
    lines = [line for line in text.splitlines() if needle in line]
    return f"found {needle!r}: {lines[0][:200]!r}" if lines else ""


# -- the probes -------------------------------------------------------------------------------------


async def probe_environ(run: _Run, traps: HostTraps, local: bool) -> ProbeResult:
    box = await run.create()
    secret = f"secret-{traps.token}"
    out = await run.sh(
        box,
        f"for f in /proc/[0-9]*/environ /proc/{traps.canary.pid}/environ /proc/{traps.owner_pid}/environ; do "
        f"tr '\\0' '\\n' < $f 2>/dev/null | grep -F {secret}; done; true",
    )
    evidence = _found(secret, out)
    return ProbeResult("environ", bool(evidence), evidence or "no other process's environment was readable")


async def probe_signal(run: _Run, traps: HostTraps, local: bool) -> ProbeResult:
    box = await run.create()
    canary = traps.canary.pid
    out = await run.sh(box, f"kill -USR1 {canary} 2>&1 && echo sent; kill -USR2 {canary} 2>&1; true")
    deadline = time.monotonic() + 1.0
    signalled = traps.signalled()
    while not signalled and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        signalled = traps.signalled()
    if signalled:
        return ProbeResult("signal", True, f"the canary (host pid {canary}) received a signal from the sandbox")
    return ProbeResult("signal", False, f"no host process was signalled (kill said {' '.join(out.split())[:160]!r})")


async def probe_other_sandbox(run: _Run, traps: HostTraps, local: bool) -> ProbeResult:
    first, second = await run.create(), await run.create()
    names = {kind: f"miles-probe-{traps.token}-{kind}" for kind in ("work", "tmp", "shm", "vartmp")}
    values = {kind: f"other-{kind}-{traps.token}" for kind in names}
    await run.provider.write_file(first, names["work"], values["work"])
    await run.sh(
        first,
        f"printf %s {values['tmp']} > /tmp/{names['tmp']}; printf %s {values['shm']} > /dev/shm/{names['shm']}; "
        f"printf %s {values['vartmp']} > /var/tmp/{names['vartmp']}; true",
    )
    paths = [f"{first.workdir}/{names['work']}" if first.workdir else names["work"]]
    host_workdir = getattr(run.provider, "host_workdir", None)
    if callable(host_workdir):
        paths.append(f"{host_workdir(first)}/{names['work']}")
    paths += [f"/tmp/{names['tmp']}", f"/dev/shm/{names['shm']}", f"/var/tmp/{names['vartmp']}"]
    quoted = " ".join(shlex.quote(p) for p in paths)
    out = await run.sh(
        second,
        f"for f in {quoted}; do cat \"$f\" 2>/dev/null; echo; done; for p in /proc/[0-9]*; do "
        f"cat $p/cwd/{names['work']} $p/root/tmp/{names['tmp']} 2>/dev/null; echo; done; true",
    )
    _remove_host_leftovers(names.values())
    hits = [kind for kind, value in values.items() if value in out]
    evidence = f"the second sandbox read the first's {', '.join(hits)} files" if hits else ""
    return ProbeResult("other_sandbox", bool(hits), evidence or "no file of the other sandbox was readable")


async def probe_escape_destroy(run: _Run, traps: HostTraps, local: bool) -> ProbeResult:
    box = await run.create()
    base = 700_000 + secrets.randbelow(200_000)
    numbers = [str(base + i) for i in range(4)]
    await run.sh(
        box,
        f"setsid env -i sleep {numbers[0]} </dev/null >/dev/null 2>&1 &\n"
        f"nohup sh -c 'exec sleep {numbers[1]}' </dev/null >/dev/null 2>&1 &\n"
        f"(setsid sh -c 'exec sleep {numbers[2]}' </dev/null >/dev/null 2>&1 &)\n"
        "sleep 0.3; echo started",
    )
    await run.provider.exec(box, ["sleep", numbers[3]], background=True)
    if not local:
        await run.destroy(box)
        return ProbeResult("escape_destroy", False, "remote sandbox: its processes are not visible here", observed=False)
    await asyncio.sleep(0.2)
    before = _processes_with_args(numbers)
    await run.destroy(box)
    deadline = time.monotonic() + 3
    survivors = _processes_with_args(numbers)
    while survivors and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        survivors = _processes_with_args(numbers)
    for line in survivors:  # the probe must not leave them behind either
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    if not before:
        return ProbeResult("escape_destroy", False, "the probe's processes never appeared on the host", observed=False)
    evidence = f"{len(survivors)} of {len(before)} survived destroy: {survivors[:2]}" if survivors else ""
    return ProbeResult("escape_destroy", bool(survivors), evidence or f"all {len(before)} ended with the sandbox")


def _remove_host_leftovers(names: Any) -> list[str]:
    found = []
    for name in names:
        for directory in ("/tmp", "/dev/shm", "/var/tmp", tempfile.gettempdir()):
            path = Path(directory) / name
            if path.exists():
                found.append(str(path))
                with contextlib.suppress(OSError):
                    path.unlink()
    return sorted(set(found))


async def probe_leftover_files(run: _Run, traps: HostTraps, local: bool) -> ProbeResult:
    box = await run.create()
    name = f"miles-probe-{traps.token}-left"
    await run.sh(box, f"for d in /tmp /dev/shm /var/tmp; do echo left > $d/{name}; done; true")
    await run.destroy(box)
    host = _remove_host_leftovers([name]) if local else []
    after = await run.create()
    seen = await run.sh(after, f"for d in /tmp /dev/shm /var/tmp; do test -e $d/{name} && echo seen $d; done; true")
    evidence = []
    if host:
        evidence.append(f"on the host after destroy: {host}")
    if "seen" in seen:
        evidence.append(f"the next sandbox saw them: {seen.split()}")
    return ProbeResult("leftover_files", bool(evidence), "; ".join(evidence) or "nothing was left behind")


async def probe_fork_loop(run: _Run, traps: HostTraps, local: bool) -> ProbeResult:
    if "processes" not in run.provider.capabilities.limits:
        return ProbeResult("fork_loop", True, "the provider enforces no process limit")
    box = await run.create(limits=replace(Limits(), processes=FORK_LIMIT))
    out = await run.sh(
        box,
        f"n=0; while [ $n -lt {FORK_TRIES} ]; do sleep 30 & echo forked; n=$((n+1)); done; kill $(jobs -p) 2>/dev/null; true",
    )
    started = out.count("forked")
    escaped = started + 1 > FORK_LIMIT  # the shell is one of the sandbox's processes too
    return ProbeResult("fork_loop", escaped, f"{started} of {FORK_TRIES} forks succeeded under processes={FORK_LIMIT}")


async def probe_network(run: _Run, traps: HostTraps, local: bool) -> ProbeResult:
    box = await run.create()
    checks = ";".join(f"try_tcp({host!r}, {port})" for host, port in traps.targets)
    program = (
        "import socket\n"
        "def try_tcp(h, p):\n"
        "    try:\n"
        "        socket.create_connection((h, p), timeout=2).close(); print('connected', h, p)\n"
        "    except OSError as e: print('refused', h, p, e)\n"
        f"{checks}\n"
        "try:\n"
        "    s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect('\\0" + traps.abstract + "'); print('connected abstract')\n"
        "except OSError as e: print('refused abstract', e)\n"
    )  # fmt: skip
    result = await run.provider.exec(box, ["python3", "-c", program], timeout=PROBE_TIMEOUT_S)
    out = result.stdout + result.stderr
    if result.exit_code == 127:
        return ProbeResult("network", False, "no python3 in the sandbox to probe with", observed=False)
    hits = [line for line in out.splitlines() if line.startswith("connected")]
    return ProbeResult("network", bool(hits), "; ".join(hits) or f"every host endpoint refused: {out.strip()[:200]}")


async def probe_host_processes(run: _Run, traps: HostTraps, local: bool) -> ProbeResult:
    box = await run.create()
    owner = traps.owner_pid
    out = await run.sh(
        box,
        f"for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done | grep -E '{traps.pattern}'; "
        f"echo '<<owner'; tr '\\0' ' ' < /proc/{owner}/cmdline 2>/dev/null; echo; echo '>>';"
        "echo visible $(ls -d /proc/[0-9]* | wc -l); true",
    )
    evidence = _found(traps.marker, out)
    host_argv = _host_cmdline(owner)
    start = out.find("<<owner\n")
    inside = out[start + 8 : out.find(">>", start)].strip() if start >= 0 else ""
    if host_argv and inside == host_argv:
        evidence = "; ".join(filter(None, [evidence, f"read the owner's (pid {owner}) argv: {host_argv[:120]!r}"]))
    visible = next((line for line in out.splitlines() if line.startswith("visible")), "")
    return ProbeResult("host_processes", bool(evidence), evidence or f"no host process visible ({visible})")


async def probe_host_files(run: _Run, traps: HostTraps, local: bool) -> ProbeResult:
    box = await run.create()
    planted = " ".join(shlex.quote(str(p)) for p in traps.files)
    identity = [p for p in ("/etc/machine-id", "/etc/hostname") if _readable_nonempty(p)]
    out = await run.sh(
        box,
        f"cat {planted} 2>/dev/null; " + " ".join(f"echo '<<{p}'; cat {p} 2>/dev/null; echo '>>';" for p in identity) + " true",
    )
    evidence = []
    if f"planted-{traps.token}" in out:
        evidence.append("read a planted world-readable host file")
    for path in identity:
        start, end = out.find(f"<<{path}\n"), -1
        if start >= 0:
            end = out.find(">>", start)
        inside = out[start + len(path) + 3 : end].strip() if start >= 0 and end >= 0 else ""
        if inside and inside == Path(path).read_text().strip():
            evidence.append(f"read the host's {path}")
    return ProbeResult("host_files", bool(evidence), "; ".join(evidence) or "no host file was readable")


def _readable_nonempty(path: str) -> bool:
    try:
        return bool(Path(path).read_text().strip())
    except OSError:
        return False


PROBE_FUNCTIONS: dict[str, Callable[[_Run, HostTraps, bool], Awaitable[ProbeResult]]] = {
    "environ": probe_environ,
    "signal": probe_signal,
    "other_sandbox": probe_other_sandbox,
    "escape_destroy": probe_escape_destroy,
    "leftover_files": probe_leftover_files,
    "fork_loop": probe_fork_loop,
    "network": probe_network,
    "host_processes": probe_host_processes,
    "host_files": probe_host_files,
}


async def run_probe(
    provider: SandboxProvider,
    name: str,
    traps: HostTraps,
    *,
    local: bool = True,
    labels: Mapping[str, str] | None = None,
) -> ProbeResult:
    """Run the probe ``name`` against ``provider``; every sandbox it made is destroyed."""
    run = _Run(provider, {"probe": name, "probe.run": uuid.uuid4().hex, **(labels or {})})
    try:
        result = await PROBE_FUNCTIONS[name](run, traps, local)
    finally:
        await run.close()
    result.claimed = name in provider.capabilities.isolates
    return result


async def hostile_probes(
    provider: SandboxProvider,
    *,
    names: list[str] | None = None,
    local: bool = True,
    labels: Mapping[str, str] | None = None,
) -> list[ProbeResult]:
    """Every probe (or ``names``) against ``provider``, one after the other."""
    with host_traps() as traps:
        return [await run_probe(provider, n, traps, local=local, labels=labels) for n in names or list(PROBES)]


# -- running the owner's side as an unprivileged user -------------------------------------------------


@dataclass(frozen=True)
class UnprivilegedPython:
    """Runs Python code as an unprivileged ``uid`` with this process's miles importable: the
    trainer's side of a sandbox as a user without root (for tests run as root)."""

    uid: int
    argv: tuple[str, ...]  # setpriv ... python -c
    bootstrap: str  # puts this process's import path in place

    def run(
        self, code: str, *args: str, timeout: float = 300.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``code`` (with ``args`` as ``sys.argv[1:]``) as this user; ``env`` is added to a
        minimal environment."""
        return subprocess.run(
            [*self.argv, f"{self.bootstrap}\n{code}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8", **(env or {})},
        )

    def miles(
        self, *args: str, timeout: float = 300.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``miles ARGS...`` as this user."""
        code = "import sys; sys.argv[0] = 'miles'\nfrom miles_core.cli import main\nmain()"
        return self.run(code, *args, timeout=timeout, env=env)


def unprivileged_python(uid: int = 65534) -> UnprivilegedPython | None:
    """An :class:`UnprivilegedPython` for ``uid``, or None when impossible here (not root, no
    ``setpriv``, or no interpreter that ``uid`` may run and import miles with)."""
    import shutil

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return None
    site_dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    plain = [p for p in sys.path if p and os.path.isdir(p) and p not in site_dirs and "python3" not in p]
    bootstrap = (
        "import site, sys\n"
        f"sys.path[:0] = {plain!r}\n"
        f"for _d in {site_dirs!r}: site.addsitedir(_d)\n"
    )
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, os.path.realpath(sys.executable), f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    drop = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
    for python in dict.fromkeys(candidates):
        if not os.path.exists(python):
            continue
        candidate = UnprivilegedPython(uid, (*drop, python, "-c"), bootstrap)
        check = (  # the interpreter must also start itself as this user (the supervisor does)
            "import subprocess, sys\n"
            "subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
            "import miles_core.sandbox.local.provider; print('ok')"
        )
        try:
            done = candidate.run(check, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == "ok":
            return candidate
    return None
