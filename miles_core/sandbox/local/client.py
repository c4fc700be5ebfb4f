"""The owner's side of the supervisor pipe: start it, send requests, match replies.

The supervisor is started with plain ``subprocess.Popen``, not asyncio's subprocess API: an
asyncio subprocess transport kills its child when it is closed or garbage-collected, and the
supervisor must outlive this object (and this process) as the keeper of its sandboxes' TTLs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from miles_core.sandbox.errors import SandboxFatalError, SandboxNotFound
from miles_core.sandbox.local.images import DEFAULT_PATH
from miles_core.sandbox.secrets import get_logger

log = get_logger(__name__)
LINE_LIMIT = 1 << 26  # one reply carries up to two capped outputs, JSON-escaped


def supervisor_env() -> dict[str, str]:
    """The whole environment the supervisor starts with: an allow list, never the owner's
    (whose API keys a sandbox could otherwise read from ``/proc/<supervisor>/environ``).

    ``PYTHONPATH`` is the owner's import path (``sys.path``, not its variable), so the
    supervisor imports the same miles as its owner.
    """
    return {
        "PATH": DEFAULT_PATH,
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isabs(p)),
    }


class SupervisorClient:
    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        reader: tuple[asyncio.StreamReader, asyncio.BaseTransport],
        writer: asyncio.StreamWriter,
    ) -> None:
        self.proc = proc
        self._replies, self._replies_transport = reader
        self._requests = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, root: Path) -> SupervisorClient:
        proc = subprocess.Popen(
            [sys.executable, "-m", "miles_core.sandbox.local.supervisor", str(root), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=supervisor_env(),
            cwd="/",
            start_new_session=True,  # a Ctrl-C aimed at the owner must not take the TTL keeper along
        )
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=LINE_LIMIT)
        read_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), proc.stdout
        )
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, proc.stdin)
        client = cls(proc, (reader, read_transport), asyncio.StreamWriter(transport, protocol, None, loop))
        await client.call("ping")
        return client

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _read(self) -> None:
        while line := await self._replies.readline():
            message = json.loads(line)
            future = self._pending.pop(message["req"], None)
            if future is not None and not future.done():
                future.set_result(message)
        code = self.proc.poll()
        ended = "exited" if code is None else f"exited (code {code})"
        error = SandboxFatalError(f"the local sandbox supervisor {ended}", provider="local")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    def _send(self, message: dict[str, Any]) -> None:
        if self._reader.done() or self._requests.is_closing():
            raise SandboxFatalError("the local sandbox supervisor is not running", provider="local")
        self._requests.write(json.dumps(message).encode() + b"\n")

    async def call(self, op: str, **payload: Any) -> dict[str, Any]:
        req = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req] = future
        self._send({"req": req, "op": op, **payload})
        try:
            reply = await future
        except asyncio.CancelledError:
            self._pending.pop(req, None)
            if op == "exec" and not self._reader.done():
                self._send({"req": next(self._ids), "op": "cancel", "target": req})
            raise
        if reply["ok"]:
            return reply
        if reply["kind"] == "not_found":
            raise SandboxNotFound(reply["message"], provider="local")
        raise SandboxFatalError(reply["message"], provider="local")

    async def aclose(self) -> None:
        """Close the pipe. A supervisor still tracking sandboxes stays on as their TTL keeper;
        an idle one exits at once and is reaped."""
        if self._reader.done():
            self.proc.poll()
            return
        tracked = (await self.call("status"))["tracked"]
        self._requests.close()  # EOF: the supervisor now acts as for a dead owner
        if tracked:
            log.info("local supervisor %d stays until the TTLs of %d sandboxes", self.pid, tracked)
            self._replies_transport.close()
            await asyncio.wait({self._reader})
        else:
            await asyncio.wait({self._reader})  # ends when the idle supervisor exits
            await asyncio.to_thread(self.proc.wait)
