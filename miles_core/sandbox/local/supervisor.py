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
* **Results the sandbox cannot forge.** It runs as the owner's user, outside every sandbox uid.

Requests: ``{"req": n, "op": ..., ...}``; replies ``{"req": n, "ok": true, ...}`` or
``{"req": n, "ok": false, "kind": "not_found"|"fatal", "message": ...}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_core.sandbox.base import Limits
from miles_core.sandbox.local.isolation import child_setup, new_network_namespace, rlimits
from miles_core.sandbox.local.spawn import Child
from miles_core.sandbox.local.store import Meta, Store
from miles_core.sandbox.ownership import process_alive, process_start_time

OWNER_POLL_S = 1.0


@dataclass
class Tracked:
    meta: Meta
    netns_fd: int | None
    timer: asyncio.TimerHandle | None = None


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

    def _destroy(self, sandbox_id: str) -> bool:
        tracked = self.tracked.get(sandbox_id)
        if tracked is not None:
            self._untrack(sandbox_id, tracked)
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
            child = Child(
                message["argv"],
                cwd=message["cwd"],
                env=message["env"],
                setup=child_setup(rlimits(limits), meta.uid, tracked.netns_fd),
                capture=not background,
            )
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:  # like a shell's 127
            return _result(127, stderr=f"{message['argv'][0]}: {exc.strerror}\n", started=started)
        if background:
            child.reap_in_background()
            return {**_result(None, started=started), "pid": child.pid}
        req = message["req"]
        self.running[req] = child
        try:
            return await child.collect(message.get("timeout"), limits.output_bytes)
        finally:
            self.running.pop(req, None)

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
    asyncio.run(serve(root, owner_pid))


if __name__ == "__main__":
    main()
