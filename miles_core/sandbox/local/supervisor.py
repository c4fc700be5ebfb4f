"""The local provider's supervisor: spawns every sandboxed process and enforces every TTL.

One supervisor runs per provider instance, as a child process in its own session, speaking
JSON lines on stdin/stdout. It exists for three reasons:

* **It outlives its owner.** When the owner dies (SIGKILL, OOM), stdin reaches EOF: the
  supervisor kills the commands in flight and keeps enforcing the remaining sandboxes' TTLs,
  destroying each at its deadline, then exits. That is the dead-man switch.
* **Fork safety.** Setting limits, namespaces and users needs code between ``fork`` and
  ``exec``; that is only safe in a single-threaded process, which the owner (a trainer with
  torch/CUDA threads) is not. The supervisor is single-threaded by construction (processes
  watched through pidfds, no executors) and small, so its forks are cheap too.
* **Results the sandbox cannot forge.** It runs outside every sandbox: as the owner's user, in
  the host's namespaces.

It starts with a scrubbed environment (:func:`miles_core.sandbox.local.client.supervisor_env`),
never the owner's. With ``isolation = "namespaces"`` each tracked sandbox has an init process
(:mod:`~miles_core.sandbox.local.namespaces`) that the supervisor starts, enters for every
command and kills to destroy it; an init that dies on its own takes its sandbox with it.

Requests: ``{"req": n, "op": ..., ...}``; replies ``{"req": n, "ok": true, ...}`` or
``{"req": n, "ok": false, "kind": "not_found"|"fatal", "message": ...}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_core.sandbox.base import Limits
from miles_core.sandbox.local import cgroups, namespaces, ns_bwrap, ns_unshare
from miles_core.sandbox.local.isolation import child_setup, new_network_namespace, rlimits
from miles_core.sandbox.local.spawn import Child
from miles_core.sandbox.local.store import Meta, Store, kill_and_wait
from miles_core.sandbox.ownership import process_alive, process_start_time

OWNER_POLL_S = 1.0
#: how long a namespace sandbox may take to start
START_TIMEOUT_S = 30.0
#: how long a keeper may take to exit after its sandbox's init ended
KEEPER_EXIT_S = 5.0


@dataclass
class Tracked:
    meta: Meta
    netns_fd: int | None
    timer: asyncio.TimerHandle | None = None
    init_pidfd: int | None = None  # namespaces: the sandbox's pid 1
    keeper: subprocess.Popen[bytes] | None = None  # namespaces, bwrap: its outer process
    keeper_pid: int | None = None  # namespaces, unshare: the monitor (our child)
    cgroup_procs: int | None = None  # namespaces with cgroups: its cgroup.procs, for new processes

    @property
    def root_owned(self) -> bool:
        """Namespaces other than the user one owned by the host's (the unshare tool as root)."""
        return self.meta.tool == "unshare" and os.geteuid() == 0


class Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Supervisor:
    def __init__(self, store: Store, owner_pid: int, writer: asyncio.StreamWriter) -> None:
        self.store = store
        self.owner_pid = owner_pid
        self.owner_start = process_start_time(owner_pid)
        self.writer = writer
        self.tracked: dict[str, Tracked] = {}
        self.running: dict[int, Child] = {}  # req -> foreground command
        self.owner_gone = asyncio.Event()
        self.idle = asyncio.Event()

    # -- plumbing ---------------------------------------------------------------------------

    def reply(self, message: dict[str, Any]) -> None:
        if self.owner_gone.is_set():
            return
        try:
            self.writer.write(json.dumps(message).encode() + b"\n")
        except (ConnectionError, RuntimeError):
            self.owner_left()

    async def handle(self, message: dict[str, Any]) -> None:
        req = message.get("req")
        try:
            result = await getattr(self, f"op_{message['op']}")(message)
            self.reply({"req": req, "ok": True, **result})
        except Failure as exc:
            self.reply({"req": req, "ok": False, "kind": exc.kind, "message": str(exc)})
        except Exception as exc:  # reported to the owner, which raises it there
            self.reply({"req": req, "ok": False, "kind": "fatal", "message": f"{type(exc).__name__}: {exc}"})

    def owner_left(self) -> None:
        if self.owner_gone.is_set():
            return
        self.owner_gone.set()
        for child in list(self.running.values()):
            child.kill_group()
        self._check_idle()

    def _check_idle(self) -> None:
        if self.owner_gone.is_set() and not self.tracked:
            self.idle.set()

    def _get(self, sandbox_id: str) -> Tracked:
        tracked = self.tracked.get(sandbox_id)
        if tracked is None:
            raise Failure("not_found", f"sandbox {sandbox_id} does not exist (destroyed or expired)")
        return tracked

    def _arm(self, tracked: Tracked) -> None:
        if tracked.timer is not None:
            tracked.timer.cancel()
        delay = max(0.0, tracked.meta.expires_at - time.time())
        tracked.timer = asyncio.get_running_loop().call_later(delay, self._expire, tracked.meta.id)

    def _expire(self, sandbox_id: str) -> None:
        tracked = self.tracked.get(sandbox_id)
        if tracked is not None and tracked.meta.expires_at <= time.time():
            self._destroy(sandbox_id)

    def _untrack(self, sandbox_id: str, tracked: Tracked) -> None:
        del self.tracked[sandbox_id]
        if tracked.timer is not None:
            tracked.timer.cancel()
        if tracked.netns_fd is not None:
            os.close(tracked.netns_fd)
        if tracked.cgroup_procs is not None:
            os.close(tracked.cgroup_procs)
            tracked.cgroup_procs = None
        if tracked.init_pidfd is not None:
            loop = asyncio.get_running_loop()
            loop.remove_reader(tracked.init_pidfd)
            try:
                signal.pidfd_send_signal(tracked.init_pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(tracked.init_pidfd)
            tracked.init_pidfd = None

    @staticmethod
    def _reap_keeper(tracked: Tracked) -> None:
        """Reap the host process that held a namespace sandbox's init (our child). It exits by
        itself once it has reaped the dead init -- killing it first would leave the init a
        zombie for the host's init to reap -- and is killed only if it does not."""
        if tracked.keeper is not None:
            try:
                tracked.keeper.wait(timeout=KEEPER_EXIT_S)
            except subprocess.TimeoutExpired:
                tracked.keeper.kill()
                tracked.keeper.wait()
        elif tracked.keeper_pid is not None:
            try:
                pidfd = os.pidfd_open(tracked.keeper_pid)
            except ProcessLookupError:
                return
            try:
                if not select.select([pidfd], [], [], KEEPER_EXIT_S)[0]:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.waitpid(tracked.keeper_pid, 0)
            except ChildProcessError:
                pass
            finally:
                os.close(pidfd)

    def _destroy(self, sandbox_id: str) -> bool:
        tracked = self.tracked.get(sandbox_id)
        meta: Meta | None
        if tracked is not None:
            self._untrack(sandbox_id, tracked)
            meta = tracked.meta
            if meta.init_pid is not None:  # the init and its keeper are gone before the reply
                kill_and_wait(meta.init_pid, meta.init_start)
            self._reap_keeper(tracked)
        else:
            meta = self.store.read_meta(sandbox_id)
        existed = self.store.remove(meta) if meta is not None else False
        self._check_idle()
        return existed

    # -- operations ---------------------------------------------------------------------------

    async def op_ping(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"pid": os.getpid()}

    async def op_status(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"tracked": len(self.tracked), "running": len(self.running)}

    async def op_track(self, message: dict[str, Any]) -> dict[str, Any]:
        meta = self.store.read_meta(message["id"])
        if meta is None:
            raise Failure("not_found", f"sandbox {message['id']} has no metadata")
        if meta.isolation == "namespaces":
            tracked = Tracked(meta, None)
            self.tracked[meta.id] = tracked
            self._arm(tracked)
            await self._start_namespaces(tracked, message.get("bwrap"), message.get("cgroup"))
            return {"init_pid": meta.init_pid, "cgroup": meta.cgroup}
        netns = new_network_namespace() if not meta.network and message.get("isolate", False) else None
        tracked = Tracked(meta, netns)
        self.tracked[meta.id] = tracked
        self._arm(tracked)
        return {}

    async def _start_namespaces(self, tracked: Tracked, bwrap: str | None, cgroup: str | None) -> None:
        """Start the sandbox's init (in a cgroup of its own below ``cgroup``, if given), wait
        until it is set up, and keep a pidfd on it."""
        meta = tracked.meta
        if cgroup is not None:
            parent, why = cgroups.find_parent(cgroup)
            if parent is None:
                raise Failure("fatal", f"sandbox {meta.id}: cgroup parent unusable: {why}")
            limits = Limits(**meta.limits)
            path = cgroups.create(
                parent, meta.id, memory_mb=limits.memory_mb, processes=limits.processes, cpus=meta.cpus
            )
            meta.cgroup = str(path)
            self.store.write_meta(meta)
            tracked.cgroup_procs = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        uid = meta.uid if meta.uid is not None else os.geteuid()
        gid = meta.uid if meta.uid is not None else os.getegid()
        layout = namespaces.build_layout(
            self.store.workdir(meta.id),
            network=meta.network,
            python=namespaces.interpreter(meta.uid is not None),
            tmpfs_mb=meta.tmpfs_mb,
        )
        directory = self.store.sandbox_dir(meta.id)
        if meta.tool == "bwrap":
            if not bwrap:
                raise Failure("fatal", "the bwrap tool was chosen but no bwrap path was given")
            log = os.open(directory / "bwrap.log", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                tracked.keeper, report = ns_bwrap.start_bwrap(
                    bwrap, layout, uid, gid, log, cgroup_procs=tracked.cgroup_procs
                )
            finally:
                os.close(log)
            keeper_pid, parse = tracked.keeper.pid, ns_bwrap.parse_bwrap_report
        else:
            staging = directory / "root"
            staging.mkdir(mode=0o700)
            keeper_pid, report = ns_unshare.start_unshare(
                layout, staging, uid, gid, cgroup_procs=tracked.cgroup_procs
            )
            tracked.keeper_pid, parse = keeper_pid, ns_unshare.read_unshare_report
        info = await _read_report(report, parse)
        if "error" in info or not info.get("ready") or "init" not in info:
            logged = ""
            if meta.tool == "bwrap":
                logged = (directory / "bwrap.log").read_text(errors="replace").strip()
            why = info.get("error") or logged or "it stopped before it was ready"
            raise Failure("fatal", f"sandbox {meta.id} did not start with {meta.tool}: {why}")
        init = int(info["init"])
        tracked.init_pidfd = os.pidfd_open(init)
        meta.init_pid, meta.init_start = init, process_start_time(init)
        meta.keeper_pid, meta.keeper_start = keeper_pid, process_start_time(keeper_pid)
        if meta.init_start is None or not process_alive(keeper_pid, meta.keeper_start):
            raise Failure("fatal", f"sandbox {meta.id} stopped while it started")
        self.store.write_meta(meta)
        asyncio.get_running_loop().add_reader(tracked.init_pidfd, self._init_exited, meta.id)

    def _init_exited(self, sandbox_id: str) -> None:
        """A namespace sandbox's init ended without a destroy (OOM, a kill from outside): the
        sandbox is gone, so forget it and clean up."""
        if sandbox_id in self.tracked:
            self._destroy(sandbox_id)

    async def op_extend(self, message: dict[str, Any]) -> dict[str, Any]:
        tracked = self._get(message["id"])
        tracked.meta.expires_at = time.time() + float(message["ttl"])
        self.store.write_meta(tracked.meta)
        self._arm(tracked)
        return {"expires_at": tracked.meta.expires_at}

    async def op_destroy(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"existed": self._destroy(message["id"])}

    async def op_cancel(self, message: dict[str, Any]) -> dict[str, Any]:
        child = self.running.get(message["target"])
        if child is not None:
            child.kill_group()
        return {}

    async def op_exec(self, message: dict[str, Any]) -> dict[str, Any]:
        tracked = self._get(message["id"])
        meta = tracked.meta
        limits = Limits(**meta.limits)
        background = bool(message.get("background"))
        started = time.monotonic()
        try:
            child = self._spawn(tracked, limits, message, capture=not background)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:  # like a shell's 127
            return _result(127, stderr=f"{message['argv'][0]}: {exc.strerror}\n", started=started)
        except subprocess.SubprocessError as exc:
            if meta.id not in self.tracked:
                raise Failure("not_found", f"sandbox {meta.id} was destroyed") from None
            raise Failure("fatal", f"could not start a command in sandbox {meta.id}: {exc}") from None
        if background:
            child.reap_in_background()
            return {**_result(None, started=started), "pid": child.pid}
        req = message["req"]
        self.running[req] = child
        try:
            return await child.collect(message.get("timeout"), limits.output_bytes)
        finally:
            self.running.pop(req, None)

    def _spawn(self, tracked: Tracked, limits: Limits, message: dict[str, Any], *, capture: bool) -> Child:
        meta = tracked.meta
        if meta.isolation != "namespaces":
            return Child(
                message["argv"],
                cwd=message["cwd"],
                env=message["env"],
                setup=child_setup(rlimits(limits), meta.uid, tracked.netns_fd),
                capture=capture,
            )
        if tracked.init_pidfd is None:
            raise Failure("not_found", f"sandbox {meta.id} is not running")
        cwd = message["cwd"]
        if cwd == namespaces.WORKDIR or cwd.startswith(namespaces.WORKDIR + "/"):
            host = self.store.workdir(meta.id) / os.path.relpath(cwd, namespaces.WORKDIR)
            if not host.is_dir():  # as Popen(cwd=...) reports it in process isolation
                raise FileNotFoundError(2, "No such file or directory", cwd)
        by_cgroup = tracked.cgroup_procs is not None  # memory and processes: the whole sandbox's
        setup: Callable[[], None] = namespaces.entering(
            tracked.init_pidfd,
            root_owned=tracked.root_owned,
            cwd=message["cwd"],
            rlimits=rlimits(limits, processes=namespace_process_limit() and not by_cgroup, address_space=not by_cgroup),
            cgroup_procs=tracked.cgroup_procs,
            end_group_on_exit=capture,
        )
        return Child(
            message["argv"],
            cwd=None,
            env=message["env"],
            setup=setup,
            capture=capture,
            pass_fds=(tracked.init_pidfd,),
            end_signal=namespaces.END_COMMAND,
        )

    # -- life -----------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Every second: is the owner alive (a pipe kept open by a fork of it hides its death),
        and did someone else (a sweep) destroy a sandbox we track? Then finish and forget it."""
        while not self.idle.is_set():
            await asyncio.sleep(OWNER_POLL_S)
            if not self.owner_gone.is_set() and not process_alive(self.owner_pid, self.owner_start):
                self.owner_left()
            for sandbox_id in list(self.tracked):
                if self.store.read_meta(sandbox_id) is None:  # finish the job: its processes too
                    self._destroy(sandbox_id)
            self._check_idle()

    def shutdown(self) -> None:
        """SIGTERM: destroy everything now rather than at the deadlines."""
        self.owner_left()
        for sandbox_id in list(self.tracked):
            self._destroy(sandbox_id)
        self.idle.set()


def namespace_process_limit() -> bool:
    """Whether ``RLIMIT_NPROC`` caps one namespace sandbox: its uid is its own (root), or the
    kernel counts processes per user namespace."""
    return os.geteuid() == 0 or namespaces.kernel_counts_processes_per_userns()


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _read_report(fd: int, parse: Callable[[bytes], dict[str, Any]]) -> dict[str, Any]:
    """Read a starting sandbox's report until it is ready, failed or closed (without blocking
    the loop: other sandboxes keep running commands meanwhile)."""
    loop = asyncio.get_running_loop()
    data = b""
    info = parse(data)
    os.set_blocking(fd, False)
    try:
        deadline = loop.time() + START_TIMEOUT_S
        while not namespaces.report_complete(info):
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _set_done, readable)
            try:
                await asyncio.wait_for(readable, max(0.0, deadline - loop.time()))
            except TimeoutError:
                return {**info, "error": f"not ready after {START_TIMEOUT_S:g}s"}
            finally:
                loop.remove_reader(fd)
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                break
            data += chunk
            info = parse(data)
        return info
    finally:
        os.close(fd)


def _result(exit_code: int | None, *, started: float, stderr: str = "") -> dict[str, Any]:
    return {
        "exit_code": exit_code,
        "stdout": "",
        "stderr": stderr,
        "timed_out": False,
        "truncated": False,
        "duration_s": time.monotonic() - started,
    }


async def serve(root: Path, owner_pid: int) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    store = Store(root)
    store.reap_expired()  # sandboxes whose supervisor died before their deadline
    supervisor = Supervisor(store, owner_pid, writer)
    loop.add_signal_handler(signal.SIGTERM, supervisor.shutdown)
    tasks: set[asyncio.Task[None]] = set()
    watcher = loop.create_task(supervisor.watch())

    async def read_requests() -> None:
        while line := await reader.readline():
            task = loop.create_task(supervisor.handle(json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        supervisor.owner_left()

    requests = loop.create_task(read_requests())
    await supervisor.idle.wait()
    requests.cancel()
    watcher.cancel()
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(requests, watcher, *tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    root, owner_pid = Path(args[0]), int(args[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # pipes and pidfds of many sandboxes
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(serve(root, owner_pid))


if __name__ == "__main__":
    main()
