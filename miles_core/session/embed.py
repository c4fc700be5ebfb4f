"""Run a session server (or any ASGI app) in a background thread on a loopback port.

A process that serves the HTTP API next to its own work (a Ray engine actor) starts it with::

    with serve_in_thread(SessionServerConfig(upstream_url=engine_url, tokenizer_dir=tok)) as url:
        ...  # POST f"{url}/sessions", ...

The port is bound before the thread starts (``port=0`` picks a free one), the context manager
returns once the server accepts connections, and leaving it shuts the server down and joins
the thread.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from miles_core.errors import ConfigError, MilesError
from miles_core.plugins import MilesPluginManager
from miles_core.session.base import PromptTokenizer
from miles_core.session.config import SessionServerConfig
from miles_core.uvicorn_signals import SignalStopped

if TYPE_CHECKING:
    from miles_core.session.workers import Router

logger = logging.getLogger("uvicorn.error")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free port), ready for uvicorn."""
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says so, and without it every reply waits ~40 ms on Nagle + delayed ACK.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from now on, before the server loop accepts them
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


#: agents often think or run tools between turns; uvicorn's default (5 s) closes their idle
#: connections, and a client that reuses one just as it closes sees a reset
KEEP_ALIVE_S = 75


def uvicorn_server(
    app: Any, *, log_level: str = "warning", access_log: bool = False, keep_alive_s: float = KEEP_ALIVE_S,
    router: Router | None = None,
) -> Any:
    """A ``uvicorn.Server`` for ``app`` with the settings every session server uses; ``router``:
    this process is one worker of several (:mod:`miles_core.session.workers`)."""
    import uvicorn

    config = uvicorn.Config(
        # uvicorn annotates timeout_keep_alive as int; it is a call_later delay, and fractions work
        app, log_level=log_level, access_log=access_log, lifespan="on", timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]
        http=coalescing_http_protocol() if router is None else routing_http_protocol(router),
        # no X-Forwarded-* rewriting of the client address and scheme: nothing here reads them,
        # and the middleware that does it costs every request a pass over its headers (~3 % of
        # the server's CPU at 1,024 agents)
        proxy_headers=False,
    )
    return _server_class(router)(config)


def _server_class(router: Router | None = None) -> type:
    """``uvicorn.Server`` stopped by signals as :class:`SignalStopped` says, accepting every
    waiting connection at once (:class:`_Acceptor`), and with a ``router``, the connections other
    workers hand over."""
    import uvicorn

    class Server(SignalStopped, uvicorn.Server):
        interrupt_exits = router is None  # a worker leaves a second Ctrl-C to its parent

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            if sockets is None:  # uvicorn binds its own listener (not how miles serves)
                await super().startup(sockets)
                return
            await super().startup([])  # the lifespan and the server state, no listener of uvicorn's
            config = self.config

            def protocol() -> asyncio.Protocol:
                return config.http_protocol_class(  # type: ignore[call-arg]
                    config=config, server_state=self.server_state, app_state=self.lifespan.state
                )

            loop = asyncio.get_running_loop()
            acceptors = [_Acceptor(loop, sock, protocol, config.backlog) for sock in sockets]
            self.servers = acceptors  # type: ignore[assignment]
            if router is not None:
                router.start(loop, acceptors[0].take_over)

    return Server


class _Acceptor:
    """Accepts the connections waiting on a listening socket -- all of them, up to ``backlog``
    per wake-up -- and hands each to the event loop's transport (``connect_accepted_socket``).

    uvloop's own server (libuv >= 1.45) accepts one connection per event-loop iteration. With
    1,024 agents the loop's iterations grew to 0.2-0.4 s (every iteration serves the turns whose
    bytes arrived), so the accept queue drained at ~4 connections/s: agents that connected last
    waited up to 21 s for their first turn while connected agents were served
    (``benchmarks/session_overhead.py --sessions 1024``). Accepting what is waiting puts
    newcomers' requests in the same iteration as everyone else's, as asyncio's own loop does.
    Stands in for the ``asyncio.Server`` uvicorn closes at shutdown.
    """

    #: after running out of file descriptors, wait this long before accepting again (asyncio's)
    RETRY_S = 1.0

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: Any, backlog: int
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._protocol = protocol
        self._backlog = max(1, backlog)
        self._pending: set[asyncio.Task[Any]] = set()
        self._closed = False
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(self._backlog):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                # out of descriptors or memory: the connections stay queued in the kernel
                logger.error("cannot accept a connection: %s; retrying in %.0f s", exc, self.RETRY_S)
                self._loop.remove_reader(self._sock.fileno())
                self._loop.call_later(self.RETRY_S, self._resume)
                return
            self._serve(conn, self._protocol)

    def _serve(self, conn: socket.socket, protocol: Any) -> None:
        """Hand ``conn`` to the event loop's transport, served by ``protocol()``."""
        task = self._loop.create_task(self._connect(conn, protocol))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _connect(self, conn: socket.socket, protocol: Any) -> None:
        try:
            await self._loop.connect_accepted_socket(protocol, conn)
        except OSError as exc:  # the peer went away before its transport was set up
            logger.debug("accepted connection lost before it was served: %s", exc)
            conn.close()

    def take_over(self, conn: socket.socket, data: bytes, serve_first: bool) -> None:
        """Serve a connection another worker handed over, with the bytes it had read from it."""

        def protocol() -> Any:
            handed = self._protocol()
            handed.take_over(data, serve_first)
            return handed

        conn.setblocking(False)
        self._serve(conn, protocol)

    def _resume(self) -> None:
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._sock.fileno())

    async def wait_closed(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


def coalescing_http_protocol() -> Any:
    """uvicorn's httptools protocol, writing each response's head and body in one ``send``.

    uvicorn writes a response's status line and headers as soon as the app starts the response
    and the body when it sends it: two system calls and two TCP segments per reply, and a client
    woken twice to read one reply. The session server always has the whole body at hand
    (:func:`~miles_core.session.server.send_reply` sends both messages back to back), so the
    head waits for it -- at most until the event loop's next iteration, for a reply without a body
    (HEAD, or a 1xx) -- and every byte keeps its order.
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class CoalescingHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            # a proxy of uvicorn's transport (every attribute but write and close forwarded)
            super().connection_made(_CoalescingTransport(transport))  # type: ignore[arg-type]

    return CoalescingHttpToolsProtocol


def routing_http_protocol(router: Router) -> Any:
    """:func:`coalescing_http_protocol` for one of several workers: a request that another
    worker must serve is not parsed here; its connection is handed to that worker
    (:meth:`~miles_core.session.workers.Router.target`, :meth:`~miles_core.session.workers.Router.hand_off`).

    Only a request that starts on a connection with nothing in progress -- no request being
    read, no reply owed -- is looked at, once its request line has arrived."""
    from miles_core.session.workers import MAX_REQUEST_LINE

    coalescing = coalescing_http_protocol()

    class RoutingHttpToolsProtocol(coalescing):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._held = b""  # the start of a request whose request line is still incomplete
            self._reading = False  # a request's bytes are being parsed
            self._initial = b""  # bytes the worker that handed this connection over had read
            self._serve_first = False  # the first request was routed here: serve it

        def take_over(self, data: bytes, serve_first: bool) -> None:
            self._initial, self._serve_first = data, serve_first

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if self._initial:
                data, self._initial = self._initial, b""
                self.data_received(data)

        def on_message_begin(self) -> None:
            self._reading = True
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._reading = False
            super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            if self._reading or self.pipeline or (self.cycle is not None and not self.cycle.response_complete):
                super().data_received(data)
                return
            if self._held:
                data, self._held = self._held + data, b""
            end = data.find(b"\r\n")
            if end < 0 and len(data) < MAX_REQUEST_LINE:
                self._held = data
                return
            target = None
            if self._serve_first:
                self._serve_first = False
            elif end >= 0:
                target = router.target(data[:end])
            if target is None or target == router.shard.index:
                super().data_received(data)
                return
            # the connection moves: a duplicate of its descriptor goes to the target, this
            # process lets go of its own (the TCP connection stays open while one is held)
            fd = os.dup(self.transport.get_extra_info("socket").fileno())
            router.hand_off(target, fd, data, serve_first=True)
            self.transport.abort()

    return RoutingHttpToolsProtocol


class _CoalescingTransport:
    """A transport that holds a response head back until the next write (see above)."""

    __slots__ = ("_head", "_transport")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._head is not None:
            data, self._head = self._head + data, None
        elif data.startswith(b"HTTP/1.1 ") and data.endswith(b"\r\n\r\n"):
            self._head = data
            asyncio.get_running_loop().call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            data, self._head = self._head, None
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


#: the serving process's young-generation garbage-collection threshold (CPython's default: 700)
GC_YOUNG_THRESHOLD = 10_000


def serve_forever(
    app: Any, sock: socket.socket, *, log_level: str = "warning", access_log: bool = False, router: Router | None = None
) -> None:
    """Serve ``app`` on ``sock`` in this process until it is stopped (``miles session serve``).

    Only for a process that exists to serve: unless the environment says otherwise, the
    ``tokenizers`` library's thread pool is turned off (``TOKENIZERS_PARALLELISM=false``: the
    server encodes one short text at a time, which the pool cannot speed up, and without it
    :meth:`~miles_core.chat_template.ChatTemplate.encode` takes its cheaper path), and
    two garbage-collector settings:

    * Everything alive at this point -- transformers, torch and the tokenizer, ~230k objects -- is
      first moved out of the cyclic collector's reach (:func:`gc.freeze`): otherwise every full
      collection rescans all of it, a ~150 ms stall of each session in flight. Frozen objects
      that later become cyclic garbage are never freed.
    * A young collection runs after :data:`GC_YOUNG_THRESHOLD` net new container objects
      instead of 700. Each turn leaves ~100 behind for a while (requests in flight, the
      session's new turn), so at the default about every seventh turn started one, and what those
      promoted -- mostly requests still in flight, garbage soon after -- made the older
      generations' collections run often and scan more: the collector took 14 % of the
      server's CPU at 1,024 agents (``benchmarks/session_overhead.py``), 8 % with this
      threshold. What the young collections scan per turn is the same either way; it happens
      in fewer, longer pauses (33 ms of CPU on average with 1,024 agents in flight, up to 17 ms
      at 64, where they come every few seconds).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    uvicorn_server(app, log_level=log_level, access_log=access_log, router=router).run(sockets=[sock])


@contextmanager
def run_app_in_thread(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout: float = 30.0,
    log_level: str = "warning",
    keep_alive_s: float = KEEP_ALIVE_S,
) -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn in a daemon thread; yield its base URL.
    ``keep_alive_s``: how long the server keeps an idle connection open."""
    sock = bind_socket(host, port)
    server = uvicorn_server(app, log_level=log_level, keep_alive_s=keep_alive_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"asgi-{host}:{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive():
                raise MilesError("the server thread exited during startup; see the log above")
            if time.monotonic() > deadline:
                raise MilesError(f"the server did not start within {startup_timeout} s")
            time.sleep(0.005)
        yield base_url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout)
        sock.close()


@contextmanager
def serve_in_thread(
    config: SessionServerConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    pm: MilesPluginManager | None = None,
    tokenizer: PromptTokenizer | None = None,
    upstream_app: Any = None,
    upstream: Any = None,
) -> Iterator[str]:
    """Build the session server for ``config`` (activation errors raise here) and serve it.

    ``upstream_app`` (the engine's ASGI app) or ``upstream`` (a factory of an
    :class:`~miles_core.session.upstream.Upstream`, e.g. an ``EngineUpstream``): for an engine in
    this process, see :func:`~miles_core.session.server.build_app`.
    """
    from miles_core.session.server import build_app

    app = build_app(config, pm=pm, tokenizer=tokenizer, upstream_app=upstream_app, upstream=upstream)
    with run_app_in_thread(app, host=host, port=port) as url:
        yield url
