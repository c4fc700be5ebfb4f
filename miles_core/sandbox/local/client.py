"""The owner's side of the supervisor pipe: start it, send requests, match replies."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

from miles_core.sandbox.errors import SandboxFatalError, SandboxNotFound
from miles_core.sandbox.secrets import get_logger

log = get_logger(__name__)


class SupervisorClient:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, root: Path) -> SupervisorClient:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "miles_core.sandbox.local.supervisor",
            str(root),
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C aimed at the owner must not take the TTL keeper along
            limit=1 << 26,
        )
        client = cls(proc)
        await client.call("ping")
        return client

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            message = json.loads(line)
            future = self._pending.pop(message["req"], None)
            if future is not None and not future.done():
                future.set_result(message)
        code = await self.proc.wait()
        error = SandboxFatalError(f"the local sandbox supervisor exited (code {code})", provider="local")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        if self._reader.done() or self.proc.stdin.is_closing():
            raise SandboxFatalError("the local sandbox supervisor is not running", provider="local")
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")

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
        """Close the pipe. A supervisor still tracking sandboxes stays, as their TTL keeper;
        an idle one exits at once and is waited for."""
        if self._reader.done():
            return
        tracked = (await self.call("status"))["tracked"]
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        if tracked:
            log.info("local supervisor %d stays until the TTLs of %d sandboxes", self.pid, tracked)
        else:
            await asyncio.shield(self._reader)
