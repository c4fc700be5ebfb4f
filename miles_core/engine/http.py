"""A lean HTTP/1.1 client connection pool: asyncio protocols and httptools (llhttp, in C).

The engine client sends one small request at a time per call and reads the whole reply. General
clients pay for features it never uses -- URL objects, cookie jars, header multidicts, tracing
hooks, a timeout context per request: aiohttp spent ~400 us of CPU on each call when calls arrive
one at a time, as a session server's do (~150 us here; ``benchmarks/session_overhead.py``).

What the pool does: keep-alive connections, reused newest first and closed after ``keepalive_s``
idle or when a reply says ``Connection: close``; at most ``max_connections`` at once (waiting for
one counts against the read ``timeout``); TLS for ``https``; replies delimited by
``Content-Length``, chunked encoding or the connection's end; informational (1xx) replies
skipped. Every failure raises the httpx exception type that says what it proves about the
request: only :class:`httpx.ConnectError` and :class:`httpx.ConnectTimeout` mean it never left.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools
import httpx

#: a reply larger than this is refused (a misbehaving engine cannot exhaust the server's memory)
MAX_REPLY_BYTES = 256 << 20
_DEFAULT_PORTS = {"http": 80, "https": 443}


class HTTPPool:
    """Connections to the origin of ``base_url``; requests name a path under its path prefix.

    ``timeout`` bounds each wait for bytes of a reply and the wait for a free connection;
    ``connect_timeout`` bounds opening one.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str],
        timeout: float,
        connect_timeout: float,
        max_connections: int,
        keepalive_s: float,
        tls: ssl.SSLContext | None = None,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        parts = urlsplit(base_url)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"engine URL must be http:// or https:// with a host, got {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or _DEFAULT_PORTS[parts.scheme]
        self._tls = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/").encode("latin-1")
        authority = parts.netloc.rsplit("@", 1)[-1]  # credentials never go into the Host header
        self._fixed_headers = _header_block({"host": authority, **headers})
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._keepalive_s = keepalive_s
        self._max_reply_bytes = max_reply_bytes
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._closed = False

    async def exchange(
        self, method: str, path: str, headers: Mapping[str, str], content: bytes | None
    ) -> tuple[int, bytes]:
        """Send one request; the reply's status and whole body."""
        if self._closed:
            raise httpx.ConnectError("the connection pool is closed")
        head = b"%s %s%s HTTP/1.1\r\n%s%s" % (
            method.encode("ascii"),
            self._prefix,
            path.encode("latin-1"),
            self._fixed_headers,
            _header_block(headers),
        )
        if content is not None:
            head += b"content-length: %d\r\n" % len(content)
        request = head + b"\r\n" + (content or b"")
        await self._acquire_slot()
        connection = None
        try:
            connection = self._pop_idle() or await self._connect()
            status, body, keep_alive = await connection.send(request, self._timeout)
        except BaseException:  # cancelled or failed mid-exchange: the connection's state is unknown
            if connection is not None:
                self._discard(connection)
            raise
        finally:
            self._slots.release()
        if keep_alive and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            self._discard(connection)
        return status, body

    async def aclose(self) -> None:
        self._closed = True
        for connection in list(self._open):
            self._discard(connection)
        self._idle.clear()

    async def _acquire_slot(self) -> None:
        if not self._slots.locked():
            await self._slots.acquire()  # returns at once: no waiter, a free slot
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), self._timeout)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no free connection within {self._timeout} s") from None

    def _pop_idle(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable() and time.monotonic() - connection.idle_since < self._keepalive_s:
                return connection
            self._discard(connection)
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = _Connection(self._max_reply_bytes)
        try:
            await asyncio.wait_for(
                loop.create_connection(
                    lambda: connection,
                    self._host,
                    self._port,
                    ssl=self._tls,
                    server_hostname=self._host if self._tls else None,
                ),
                self._connect_timeout,
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"connecting to {self._host}:{self._port} took over {self._connect_timeout} s"
            ) from None
        except OSError as exc:  # refused, unreachable, name resolution, TLS handshake
            raise httpx.ConnectError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        self._open.add(connection)
        return connection

    def _discard(self, connection: _Connection) -> None:
        connection.abort()
        self._open.discard(connection)


def _header_block(headers: Mapping[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0"):
            raise ValueError(f"HTTP header {name!r} contains a line break or NUL")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


class _Connection(asyncio.Protocol):
    """One connection; at most one request in flight. Also the httptools parser's callbacks."""

    def __init__(self, max_reply_bytes: int) -> None:
        self.idle_since = 0.0
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._max_reply_bytes = max_reply_bytes
        self._reply: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        self._last_read = 0.0
        self._reset_message()

    def _reset_message(self) -> None:
        self._status = 0
        self._keep_alive = False
        self._headers_done = False
        self._length_known = False  # Content-Length or chunked; otherwise the body ends with the connection
        self._chunks: list[bytes] = []
        self._size = 0

    # -- used by the pool ---------------------------------------------------------------------

    def usable(self) -> bool:
        """Connected, and neither closed by the engine nor aborted here."""
        return self._transport is not None and not self._transport.is_closing()

    def send(self, request: bytes, timeout: float) -> asyncio.Future[tuple[int, bytes, bool]]:
        """Write ``request``; the future's result is (status, body, keep-alive). ``timeout``
        bounds each wait for bytes from the engine."""
        assert self._transport is not None and self._reply is None
        loop = asyncio.get_running_loop()
        self._reply = loop.create_future()
        self._reset_message()
        self._timeout = timeout
        self._last_read = loop.time()
        self._timer = loop.call_at(self._last_read + timeout, self._check_read_timeout)
        self._transport.write(request)
        return self._reply

    def abort(self) -> None:
        self._cancel_timer()
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio subclasses

    def data_received(self, data: bytes) -> None:
        if self._reply is None:  # bytes nobody asked for: the framing can no longer be trusted
            self.abort()
            return
        self._last_read = self._reply.get_loop().time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, httpx.TransportError) else httpx.RemoteProtocolError(str(exc)))
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(httpx.RemoteProtocolError(f"the engine's reply is not valid HTTP/1.1: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._reply is None:
            return
        if exc is None and self._headers_done and not self._length_known:
            self._finish()  # a body delimited by the end of the connection
        elif exc is not None:
            self._fail(httpx.ReadError(f"connection to the engine broke: {type(exc).__name__}: {exc}"))
        else:
            self._fail(httpx.RemoteProtocolError("the engine closed the connection without a complete reply"))

    # -- parser callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._reply is None:  # a second reply in the bytes of the first: see data_received
            self.abort()

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self._length_known = True

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._max_reply_bytes:
            raise httpx.RemoteProtocolError(f"the engine's reply exceeds {self._max_reply_bytes} bytes")
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        if 100 <= self._status < 200:  # informational: the real reply follows
            self._reset_message()
            return
        self._finish()

    # -- internals -------------------------------------------------------------------------------

    def _finish(self) -> None:
        reply, self._reply = self._reply, None
        self._cancel_timer()
        if reply is not None and not reply.done():
            reply.set_result((self._status, b"".join(self._chunks), self._keep_alive and self.usable()))

    def _fail(self, error: httpx.TransportError) -> None:
        reply, self._reply = self._reply, None
        self.abort()
        if reply is not None and not reply.done():
            reply.set_exception(error)

    def _check_read_timeout(self) -> None:
        if self._reply is None:
            return
        loop = self._reply.get_loop()
        deadline = self._last_read + self._timeout
        if loop.time() < deadline:
            self._timer = loop.call_at(deadline, self._check_read_timeout)
            return
        self._fail(httpx.ReadTimeout(f"no bytes from the engine for {self._timeout} s"))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
