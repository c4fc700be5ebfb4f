"""One sandboxed process in the supervisor: started with ``Popen``, watched through its pidfd.

No asyncio child watcher and no helper threads: the supervisor must stay single-threaded for
its ``preexec_fn`` forks to be safe, and a pidfd tells when the *command* exits -- asyncio's
``Process.wait()`` also waits for every holder of its output pipes (descendants included).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

READ_CHUNK = 1 << 16
#: after a command exits, how long to wait for descendants that left its process group but
#: still hold its output pipes
PIPE_GRACE_S = 0.5


class Child:
    def __init__(
        self,
        argv: list[str],
        *,
        cwd: str | None,
        env: dict[str, str],
        setup: Callable[[], None],
        capture: bool,
        pass_fds: tuple[int, ...] = (),
        end_signal: int | None = None,
    ) -> None:
        """``end_signal``: the process is a waiter that ends its command on this signal
        (:func:`~miles_core.sandbox.local.namespaces.entering`) and must not be killed itself;
        None: it is the command, and its process group is SIGKILLed."""
        self.end_signal = end_signal
        target = subprocess.PIPE if capture else subprocess.DEVNULL
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=target,
            stderr=target,
            start_new_session=True,
            preexec_fn=setup,
            pass_fds=pass_fds,
        )
        self.pidfd = os.pidfd_open(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill_group(self) -> None:
        """SIGKILL the command's process group (a reaped leader's group may still have members)."""
        if self.end_signal is not None:  # through the pidfd: the waiter may have been reaped
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, self.end_signal)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def reap_in_background(self) -> None:
        """For background commands: reap the process whenever it exits."""
        loop = asyncio.get_running_loop()

        def reap() -> None:
            loop.remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.proc.wait()

        loop.add_reader(self.pidfd, reap)

    async def _exited(self) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(self.pidfd, wake)
        try:
            await done
        finally:
            loop.remove_reader(self.pidfd)

    async def collect(self, timeout: float | None, cap: int) -> dict[str, Any]:
        """Wait for the command (killing it at ``timeout``), then its output, capped at ``cap``."""
        loop = asyncio.get_running_loop()
        buffers = {"stdout": bytearray(), "stderr": bytearray()}
        truncated = False
        pending: list[asyncio.Future[None]] = []
        for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            assert stream is not None
            fd, buf, eof = stream.fileno(), buffers[name], loop.create_future()
            os.set_blocking(fd, False)

            def readable(fd: int = fd, buf: bytearray = buf, eof: asyncio.Future[None] = eof) -> None:
                nonlocal truncated
                try:
                    chunk = os.read(fd, READ_CHUNK)
                except BlockingIOError:
                    return
                if not chunk:
                    loop.remove_reader(fd)
                    eof.set_result(None)
                    return
                room = cap - len(buf)
                buf += chunk[: max(room, 0)]
                truncated = truncated or len(chunk) > room

            loop.add_reader(fd, readable)
            pending.append(eof)
        timed_out = False
        try:
            try:
                await asyncio.wait_for(self._exited(), timeout)
            except TimeoutError:
                timed_out = True
            self.kill_group()  # nothing a foreground command started outlives it
            await asyncio.wait(pending, timeout=PIPE_GRACE_S)
        finally:
            for stream in (self.proc.stdout, self.proc.stderr):
                assert stream is not None
                loop.remove_reader(stream.fileno())
                stream.close()
            self.kill_group()
            returncode = self.proc.wait()
            os.close(self.pidfd)
        return {
            "exit_code": returncode,
            "stdout": buffers["stdout"].decode(errors="replace"),
            "stderr": buffers["stderr"].decode(errors="replace"),
            "timed_out": timed_out,
            "truncated": truncated,
            "duration_s": time.monotonic() - self.started,
        }
