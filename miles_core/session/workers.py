"""One session server served by several processes (``miles session serve --workers N``).

A session server is one event loop on one core; at ~1,000 concurrent agents that core is the
limit (``benchmarks/session_overhead.py --sessions 1024``). With ``N`` workers every worker
accepts connections from the one listening socket, and each session lives in exactly one of
them, its *owner*: ``crc32(session id) % N`` (:func:`owner_of`). A worker creates only session
ids it owns, and ``POST /sessions`` requests are spread round-robin over the workers.

Requests reach their owner by moving the connection, not by proxying the request: when a request
for another worker's session (or a ``POST /sessions`` it should create) starts on a connection
that is between requests, the worker passes the connection's file descriptor and the bytes it
has read (``SCM_RIGHTS`` over a ``SOCK_SEQPACKET`` pair per ordered pair of workers) to the
target, which replays those bytes as if it had read them itself and serves that connection from
then on. An agent that keeps its own connection is moved at most once; the TCP connection itself
never notices. A request that cannot be moved -- pipelined behind another on the same
connection, or whose request line does not fit the first 64 KiB read -- is answered
``421 Misdirected Request`` by a worker that does not own its session (the client may retry it on
another connection, RFC 9110 15.5.20). ``GET /health`` is answered by whichever worker reads it.

Limits are per worker: each holds at most ``ceil(max_sessions / N)`` sessions.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import signal
import socket
import struct
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from miles_core.errors import INTERRUPTED, ConfigError, MilesError
from miles_core.session.config import ServiceLimits, SessionServerConfig

logger = logging.getLogger("uvicorn.error")

#: how much of a request the first read may hold for its request line to be looked at
MAX_REQUEST_LINE = 64 << 10
#: bytes per handoff message (a SOCK_SEQPACKET message must fit the socket's send buffer)
CHUNK = 32 << 10
#: first message of a handoff: total bytes, whether the target serves the first request itself
_HEADER = struct.Struct("!IB")


def owner_of(session_id: str, workers: int) -> int:
    """The worker (0-based) that holds ``session_id`` in a server of ``workers`` workers."""
    return zlib.crc32(session_id.encode()) % workers


@dataclass(frozen=True)
class Shard:
    """Which of ``count`` workers this process is."""

    index: int
    count: int

    def owns(self, session_id: str) -> bool:
        return owner_of(session_id, self.count) == self.index

    def new_ids(self, n: int) -> list[str]:
        """``n`` fresh session ids this worker owns (``count`` draws per id, on average)."""
        from miles_core.session.service import new_session_ids

        ids: list[str] = []
        while len(ids) < n:
            ids += [i for i in new_session_ids(max(n - len(ids), 1) * self.count) if self.owns(i)]
        return ids[:n]

    def limits(self, limits: ServiceLimits) -> ServiceLimits:
        return ServiceLimits(max_sessions=math.ceil(limits.max_sessions / self.count), max_turns=limits.max_turns)


class Router:
    """This worker's end of the handoff channels: ``outgoing[k]`` sends to worker ``k``,
    ``incoming`` receives from every other worker."""

    def __init__(self, shard: Shard, outgoing: dict[int, socket.socket], incoming: list[socket.socket]) -> None:
        self.shard = shard
        self.outgoing = outgoing
        self.incoming = incoming
        self._next_create = 0  # the last round-robin offset a POST /sessions went to
        self._queues: dict[int, deque[tuple[bytes, int | None]]] = {}  # per target: messages not yet sent
        # per incoming channel: a connection whose bytes are still arriving (total, bytes, serve_first, socket)
        self._partial: dict[int, tuple[int, bytearray, bool, socket.socket]] = {}

    # -- deciding -------------------------------------------------------------------------------

    def target(self, request_line: bytes) -> int | None:
        """The worker that must serve a request starting with ``request_line`` (``None``: any)."""
        parts = request_line.split(b" ")
        if len(parts) != 3:
            return None
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        if path.startswith(b"/sessions/"):
            session_id = path[len(b"/sessions/"):].split(b"/", 1)[0]
            if not session_id:
                return None
            text = session_id.decode("latin-1")
            return owner_of(unquote(text) if "%" in text else text, self.shard.count)
        if method == b"POST" and path == b"/sessions":
            self._next_create = (self._next_create + 1) % self.shard.count
            return (self.shard.index + self._next_create) % self.shard.count
        return None

    # -- sending --------------------------------------------------------------------------------

    def hand_off(self, target: int, fd: int, data: bytes, *, serve_first: bool) -> None:
        """Pass ``fd`` (a duplicate this router now owns and closes) and the bytes read from it."""
        messages: list[tuple[bytes, int | None]] = [(_HEADER.pack(len(data), serve_first) + data[:CHUNK], fd)]
        messages += [(data[i : i + CHUNK], None) for i in range(CHUNK, len(data), CHUNK)]
        queue = self._queues.setdefault(target, deque())
        was_idle = not queue
        queue.extend(messages)
        if was_idle:
            self._flush(target)

    def _flush(self, target: int) -> None:
        sock, queue = self.outgoing[target], self._queues[target]
        loop = asyncio.get_running_loop()
        while queue:
            payload, fd = queue[0]
            try:
                if fd is None:
                    sock.send(payload)
                else:
                    socket.send_fds(sock, [payload], [fd])
            except BlockingIOError:
                loop.add_writer(sock.fileno(), self._resume, target)
                return
            queue.popleft()
            if fd is not None:
                os.close(fd)

    def _resume(self, target: int) -> None:
        asyncio.get_running_loop().remove_writer(self.outgoing[target].fileno())
        self._flush(target)

    # -- receiving ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, accept: Callable[[socket.socket, bytes, bool], None]) -> None:
        """Receive connections from the other workers; ``accept(sock, data, serve_first)``."""
        for sock in self.incoming:
            sock.setblocking(False)
            loop.add_reader(sock.fileno(), self._receive, sock, accept)
        for sock in self.outgoing.values():
            sock.setblocking(False)

    def _receive(self, channel: socket.socket, accept: Callable[[socket.socket, bytes, bool], None]) -> None:
        while True:
            try:
                payload, fds, _, _ = socket.recv_fds(channel, _HEADER.size + CHUNK, 1)
            except BlockingIOError:
                return
            key = channel.fileno()
            if fds:
                if key in self._partial:  # cannot happen: messages of one pair stay in order
                    raise MilesError("session worker handoff: a connection arrived before the last one was complete")
                total, serve_first = _HEADER.unpack_from(payload)
                conn = socket.socket(fileno=fds[0])
                self._partial[key] = (total, bytearray(payload[_HEADER.size :]), bool(serve_first), conn)
            elif not payload:  # the other worker is gone (the parent stops the server): stop listening
                asyncio.get_running_loop().remove_reader(channel.fileno())
                return
            else:
                self._partial[key][1].extend(payload)
            total, data, serve_first, conn = self._partial[key]
            if len(data) >= total:
                del self._partial[key]
                accept(conn, bytes(data), serve_first)


def channels(count: int) -> dict[tuple[int, int], tuple[socket.socket, socket.socket]]:
    """A ``SOCK_SEQPACKET`` pair per ordered pair of workers: ``(sender end, receiver end)``."""
    return {
        (j, k): socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for j in range(count) for k in range(count) if j != k
    }


def serve_workers(
    config: SessionServerConfig,
    sock: socket.socket,
    workers: int,
    *,
    log_level: str = "warning",
    access_log: bool = False,
    on_started: Callable[[list[int]], None] | None = None,
) -> int:
    """Serve ``config`` on ``sock`` from ``workers`` processes until one exits or this process is
    asked to stop (SIGINT/SIGTERM, passed on to every worker as SIGTERM); the first nonzero exit
    code of a worker (0 after a requested stop). A SIGINT while the workers stop (Ctrl-C pressed
    again) kills them at once: :data:`~miles_core.errors.INTERRUPTED` (130). A terminal's
    Ctrl-C reaches the workers as well; they stop on the first and leave the second to this
    process. ``on_started``: called with the workers' pids."""
    from miles_core.uvicorn_signals import STOP_SIGNALS

    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    ctx = multiprocessing.get_context("spawn")
    pairs = channels(workers)
    processes = []
    for index in range(workers):
        outgoing = {k: pairs[index, k][0] for k in range(workers) if k != index}
        incoming = [pairs[j, index][1] for j in range(workers) if j != index]
        process = ctx.Process(
            target=_worker_main, name=f"miles-session-worker-{index}",
            args=(config, sock, Shard(index, workers), outgoing, incoming, log_level, access_log),
        )
        process.start()
        processes.append(process)
    for ends in pairs.values():
        for end in ends:
            end.close()
    if on_started is not None:
        on_started([p.pid for p in processes if p.pid is not None])
    stopping = forced = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping, forced
        forced = forced or (stopping and signum == signal.SIGINT)  # interrupted again: stop waiting
        stopping = True
        for p in processes:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL if forced else signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        from multiprocessing.connection import wait

        code = 0
        remaining = list(processes)
        while remaining:
            wait([p.sentinel for p in remaining])
            for p in [p for p in remaining if not p.is_alive()]:
                remaining.remove(p)
                if p.exitcode and not code and not stopping:
                    code = p.exitcode if p.exitcode > 0 else 128 - p.exitcode
                    logger.error("session worker %s exited with code %s; stopping the others", p.name, p.exitcode)
                if not stopping:
                    stop(signal.SIGTERM, None)
        if forced:
            logger.warning("interrupted again: stopped the workers without waiting for the requests in flight")
        return code or (INTERRUPTED if forced else 0)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _worker_main(
    config: SessionServerConfig, sock: socket.socket, shard: Shard,
    outgoing: dict[int, socket.socket], incoming: list[socket.socket], log_level: str, access_log: bool,
) -> None:
    from miles_core.session.embed import serve_forever
    from miles_core.session.server import build_app

    app = build_app(config)
    app.shard = shard
    serve_forever(app, sock, log_level=log_level, access_log=access_log, router=Router(shard, outgoing, incoming))
