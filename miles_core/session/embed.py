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
import gc
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from miles_core.errors import ConfigError, MilesError
from miles_core.plugins import MilesPluginManager
from miles_core.session.base import PromptTokenizer
from miles_core.session.config import SessionServerConfig


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
    app: Any, *, log_level: str = "warning", access_log: bool = False, keep_alive_s: float = KEEP_ALIVE_S
) -> Any:
    """A ``uvicorn.Server`` for ``app`` with the settings every session server uses."""
    import uvicorn

    config = uvicorn.Config(
        # uvicorn annotates timeout_keep_alive as int; it is a call_later delay, and fractions work
        app, log_level=log_level, access_log=access_log, lifespan="on", timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]
        http=coalescing_http_protocol(),
    )
    return uvicorn.Server(config)


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


def serve_forever(app: Any, sock: socket.socket, *, log_level: str = "warning", access_log: bool = False) -> None:
    """Serve ``app`` on ``sock`` in this process until it is stopped (``miles session serve``).

    Everything alive at this point -- transformers, torch and the tokenizer, ~230k objects -- is
    first moved out of the cyclic garbage collector's reach (:func:`gc.freeze`): otherwise every
    full collection rescans all of it, a ~150 ms stall of each session in flight. Only for a
    process that exists to serve: frozen objects that later become cyclic garbage are never freed.
    """
    gc.freeze()
    uvicorn_server(app, log_level=log_level, access_log=access_log).run(sockets=[sock])


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
