"""The local provider's supervisor: spawns every sandboxed process and enforces every TTL.

One supervisor runs per provider instance, as a child process in its own session, speaking
JSON lines on stdin/stdout. It exists for three reasons:

* **It outlives its owner.** When the owner dies (SIGKILL, OOM), stdin reaches EOF: the
  supervisor kills the commands in flight and keeps enforcing the remaining sandboxes' TTLs,
  destroying each at its deadline, then exits. That is the dead-man switch.
* **Fork safety.** Setting limits, namespaces and users needs code between ``fork`` and
  ``exec``; that is only safe in a single-threaded process, which the owner (a trainer with
  torch/CUDA threads) is not. The supervisor is single-threaded by construction (pidfd child
  watcher, no executors) and small, so its forks are cheap too.
* **Results the sandbox cannot forge.** It runs as the owner's user, outside every sandbox uid.

Requests: ``{"req": n, "op": ..., ...}``; replies ``{"req": n, "ok": true, ...}`` or
``{"req": n, "ok": false, "kind": "not_found"|"fatal", "message": ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.sandbox.base import Limits
from miles_core.sandbox.local.isolation import child_setup, new_network_namespace, rlimits
from miles_core.sandbox.local.store import Meta, Store

OWNER_POLL_S = 1.0
#: after a command exits, how long to wait for descendants that escaped its process group
#: but still hold its output pipes
PIPE_GRACE_S = 0.5
READ_CHUNK = 1 << 16


@dataclass
class Tracked:
    meta: Meta
    netns_fd: int | None
    timer: asyncio.TimerHandle | None = None
    execs: set[int] = field(default_factory=set)


class Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Supervisor:
    def __init__(self, store: Store, owner_pid: int, writer: asyncio.StreamWriter) -> None:
        self.store = store
        self.owner_pid = owner_pid
        self.writer = writer
        self.tracked: dict[str, Tracked] = {}
        self.running: dict[int, asyncio.subprocess.Process] = {}  # req -> foreground process
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
        for proc in list(self.running.values()):
            _kill_group(proc.pid)
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
        loop = asyncio.get_running_loop()
        tracked.timer = loop.call_later(delay, lambda: loop.create_task(self._expire(tracked.meta.id)))

    async def _expire(self, sandbox_id: str) -> None:
        tracked = self.tracked.get(sandbox_id)
        if tracked is not None and tracked.meta.expires_at <= time.time():
            self._destroy(sandbox_id)

    def _destroy(self, sandbox_id: str) -> bool:
        tracked = self.tracked.pop(sandbox_id, None)
        if tracked is not None:
            if tracked.timer is not None:
                tracked.timer.cancel()
            if tracked.netns_fd is not None:
                os.close(tracked.netns_fd)
            meta = tracked.meta
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
        netns = new_network_namespace() if not meta.network and message.get("isolate", False) else None
        tracked = Tracked(meta, netns)
        self.tracked[meta.id] = tracked
        self._arm(tracked)
        return {}

    async def op_extend(self, message: dict[str, Any]) -> dict[str, Any]:
        tracked = self._get(message["id"])
        tracked.meta.expires_at = time.time() + float(message["ttl"])
        self.store.write_meta(tracked.meta)
        self._arm(tracked)
        return {"expires_at": tracked.meta.expires_at}

    async def op_destroy(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"existed": self._destroy(message["id"])}

    async def op_cancel(self, message: dict[str, Any]) -> dict[str, Any]:
        proc = self.running.get(message["target"])
        if proc is not None:
            _kill_group(proc.pid)
        return {}

    async def op_exec(self, message: dict[str, Any]) -> dict[str, Any]:
        tracked = self._get(message["id"])
        meta = tracked.meta
        limits = Limits(**meta.limits)
        background = bool(message.get("background"))
        pipe = asyncio.subprocess.DEVNULL if background else asyncio.subprocess.PIPE
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *message["argv"],
                cwd=message["cwd"],
                env=message["env"],
                stdin=asyncio.subprocess.DEVNULL,
                stdout=pipe,
                stderr=pipe,
                start_new_session=True,
                preexec_fn=child_setup(rlimits(limits), meta.uid, tracked.netns_fd),
            )
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            return {
                "exit_code": 127,
                "stdout": "",
                "stderr": f"{message['argv'][0]}: {exc.strerror}\n",
                "timed_out": False,
                "truncated": False,
                "duration_s": time.monotonic() - started,
            }
        if background:
            return {
                "exit_code": None,
                "pid": proc.pid,
                "stdout": "",
                "stderr": "",
                "timed_out": False,
                "truncated": False,
                "duration_s": time.monotonic() - started,
            }
        req = message["req"]
        self.running[req] = proc
        tracked.execs.add(req)
        try:
            return await self._collect(proc, message.get("timeout"), limits.output_bytes, started)
        finally:
            self.running.pop(req, None)
            tracked.execs.discard(req)

    async def _collect(
        self, proc: asyncio.subprocess.Process, timeout: float | None, cap: int, started: float
    ) -> dict[str, Any]:
        out, err = bytearray(), bytearray()
        truncated = [False]

        async def drain(stream: asyncio.StreamReader, buf: bytearray) -> None:
            while chunk := await stream.read(READ_CHUNK):
                room = cap - len(buf)
                buf += chunk[: max(room, 0)]
                if len(chunk) > room:
                    truncated[0] = True

        assert proc.stdout is not None and proc.stderr is not None
        readers = asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err))
        timed_out = False
        try:
            await asyncio.wait_for(_exited(proc.pid), timeout)
        except TimeoutError:
            timed_out = True
        _kill_group(proc.pid)  # nothing a foreground command started outlives it
        await proc.wait()
        try:
            await asyncio.wait_for(asyncio.shield(readers), PIPE_GRACE_S)
        except TimeoutError:
            readers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await readers
        return {
            "exit_code": proc.returncode,
            "stdout": out.decode(errors="replace"),
            "stderr": err.decode(errors="replace"),
            "timed_out": timed_out,
            "truncated": truncated[0],
            "duration_s": time.monotonic() - started,
        }

    # -- life -----------------------------------------------------------------------------------

    async def watch_owner(self) -> None:
        while not self.owner_gone.is_set():
            await asyncio.sleep(OWNER_POLL_S)
            try:
                os.kill(self.owner_pid, 0)
            except ProcessLookupError:
                self.owner_left()

    def shutdown(self) -> None:
        """SIGTERM: destroy everything now rather than at the deadlines."""
        self.owner_left()
        for sandbox_id in list(self.tracked):
            self._destroy(sandbox_id)
        self.idle.set()


async def _exited(pid: int) -> None:
    """Return when ``pid`` exits. ``Process.wait()`` would also wait for every holder of its
    output pipes to close them -- descendants included -- which is not the command's end."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # already exited and reaped
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


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
    watcher = loop.create_task(supervisor.watch_owner())

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
    if sys.version_info < (3, 12):  # 3.12+ picks the pidfd watcher itself; no helper threads
        asyncio.set_child_watcher(asyncio.PidfdChildWatcher())
    asyncio.run(serve(root, owner_pid))


if __name__ == "__main__":
    main()
