"""A lean HTTP/1.1 client connection pool: asyncio protocols and httptools (llhttp, in C).

The engine client sends one small request at a time per call and reads the whole reply. General
clients pay for features it never uses -- URL objects, cookie jars, header multidicts, tracing
hooks, a timeout context per request: aiohttp spent ~400 us of CPU on each call when calls arrive
one at a time, as a session server's do (~150 us here; ``benchmarks/session_overhead.py``).

What the pool does: keep-alive connections, reused newest first and closed after ``keepalive_s``
idle or when a reply says ``Connection: close``; at most ``max_connections`` at once; TLS for
``https``; replies delimited by ``Content-Length``, chunked encoding or the connection's end;
informational (1xx) replies skipped. What it promises:

* **One deadline per request.** ``timeout`` bounds the whole exchange -- waiting for a free
  connection, connecting, sending and reading the complete reply -- so a peer that trickles
  bytes cannot hold a request past it.
* **Bounded replies.** A reply head (status line and headers) over ``max_header_bytes`` or a
  body over ``max_reply_bytes`` is refused as it arrives, before it is buffered whole.
* **No stale reuse.** Before an idle connection is reused its socket is polled: an idle HTTP/1.1
  connection has nothing to say, so a readable socket means the peer closed it (its keep-alive
  timer fired, possibly while this event loop was too busy to notice) or sent bytes nobody asked
  for; either way it is dropped and another one used.
* **One retry for the keep-alive race**, see :meth:`HTTPPool.exchange`.

Every failure raises the httpx exception type that says what it proves about the request: only
:class:`httpx.ConnectError` and :class:`httpx.ConnectTimeout` mean it never left.
"""

from __future__ import annotations

import asyncio
import select
import ssl
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools
import httpx

#: a reply larger than this is refused (a misbehaving engine cannot exhaust the server's memory)
MAX_REPLY_BYTES = 256 << 20
#: a reply head (status line + headers) larger than this is refused; real ones are < 1 KiB
MAX_HEADER_BYTES = 64 << 10
_DEFAULT_PORTS = {"http": 80, "https": 443}


class HTTPPool:
    """Connections to the origin of ``base_url``; requests name a path under its path prefix.

    ``timeout`` bounds each request as a whole (slot wait, connect, send, complete reply);
    ``connect_timeout`` bounds each attempt to open a connection within it.
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
        max_header_bytes: int = MAX_HEADER_BYTES,
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
        self._limits = (max_reply_bytes, max_header_bytes)
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._closed = False

    async def exchange(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        content: bytes | None,
        *,
        deadline: float | None = None,
    ) -> tuple[int, bytes]:
        """Send one request; the reply's status and whole body.

        ``deadline`` (event-loop time) replaces ``now + timeout``: a caller that retries uses it
        to bound all its attempts together.

        **The keep-alive race.** A server closes an idle connection when its keep-alive timer
        fires, and a request written at that moment is lost in flight: the server has stopped
        reading, the kernel answers the bytes with a reset or the connection just ends. The pool
        then retries the request once, on a new connection, when -- and only when -- the
        connection had already served a reply (it was reused) and it ended before a single byte
        of this reply arrived. That is the rule RFC 9112 section 9.3.1 gives clients for
        retrying on a persistent connection, and it is safe for the engine's requests even
        though a chat completion is not idempotent:

        * An HTTP/1.1 server answers every request it has read -- at worst with a 5xx -- before
          it closes the connection on its own; closing without a byte of reply is what it does
          to a connection it considers idle, whose bytes it never read.
        * The remaining case is a server that read the request and then died. Nothing it did
          for that request reached anyone: the engine keeps no per-request state that a second
          request could duplicate (a prefix cache at most), the session server records only
          replies, and a generation that was never returned is not in any trajectory. A retry
          is then an ordinary new request (a fresh connection: it fails at connect if the
          server is gone).

        A fresh connection that ends without a reply, a reply cut off after its first byte, and
        every timeout are never retried: they may mean the engine is working on the request.
        """
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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout if deadline is None else deadline
        await self._acquire_slot(deadline)
        try:
            connection = self._pop_idle()
            if connection is not None:
                try:
                    return await self._send(connection, request, deadline)
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    if not connection.ended_before_reply:
                        raise
                    # the keep-alive race (see above): once, on a connection of its own
            return await self._send(await self._connect(deadline), request, deadline)
        finally:
            self._slots.release()

    async def aclose(self) -> None:
        self._closed = True
        for connection in list(self._open):
            self._discard(connection)
        self._idle.clear()

    async def _send(self, connection: _Connection, request: bytes, deadline: float) -> tuple[int, bytes]:
        try:
            status, body, keep_alive = await connection.send(request, deadline, self._timeout)
        except BaseException:  # cancelled or failed mid-exchange: the connection's state is unknown
            self._discard(connection)
            raise
        if keep_alive and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            self._discard(connection)
        return status, body

    async def _acquire_slot(self, deadline: float) -> None:
        if not self._slots.locked():
            await self._slots.acquire()  # returns at once: no waiter, a free slot
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no free connection within {self._timeout} s") from None

    def _pop_idle(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if time.monotonic() - connection.idle_since < self._keepalive_s and connection.reusable():
                return connection
            self._discard(connection)
        return None

    async def _connect(self, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = _Connection(*self._limits)
        budget = min(self._connect_timeout, deadline - loop.time())
        try:
            if budget <= 0:
                raise TimeoutError
            await asyncio.wait_for(
                loop.create_connection(
                    lambda: connection,
                    self._host,
                    self._port,
                    ssl=self._tls,
                    server_hostname=self._host if self._tls else None,
                ),
                budget,
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"connecting to {self._host}:{self._port} took over {max(budget, 0.0):.3g} s"
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


if hasattr(select, "poll"):

    def _readable(fd: int) -> bool:
        """Whether ``fd`` has bytes, an end of stream or an error waiting (without reading)."""
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))

else:  # Windows: select() takes sockets of any number there

    def _readable(fd: int) -> bool:
        """Whether ``fd`` has bytes, an end of stream or an error waiting (without reading)."""
        return bool(select.select([fd], [], [fd], 0)[0])


class _Connection(asyncio.Protocol):
    """One connection; at most one request in flight. Also the httptools parser's callbacks."""

    def __init__(self, max_reply_bytes: int, max_header_bytes: int) -> None:
        self.idle_since = 0.0
        #: this connection ended (closed or reset) before any byte of the reply in flight came
        self.ended_before_reply = False
        self._transport: asyncio.Transport | None = None
        self._fd = -1
        self._parser = httptools.HttpResponseParser(self)
        self._max_reply_bytes = max_reply_bytes
        self._max_header_bytes = max_header_bytes
        self._reply: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        self._received = 0
        self._reset_message()

    def _reset_message(self) -> None:
        self._status = 0
        self._keep_alive = False
        self._headers_done = False
        self._head_bytes = 0  # of the reply head so far: bytes of chunks that ended inside it
        self._field_bytes = 0  # of the status line and header fields parsed so far
        self._length_known = False  # Content-Length or chunked; otherwise the body ends with the connection
        self._chunks: list[bytes] = []
        self._size = 0

    # -- used by the pool ---------------------------------------------------------------------

    def reusable(self) -> bool:
        """Open, and its socket silent: for an idle connection, readable means the peer closed
        it or sent bytes nobody asked for (this loop may not have run since)."""
        if self._transport is None or self._transport.is_closing():
            return False
        try:
            return self._fd < 0 or not _readable(self._fd)
        except (OSError, ValueError):  # the descriptor is gone
            return False

    def send(
        self, request: bytes, deadline: float, timeout: float
    ) -> asyncio.Future[tuple[int, bytes, bool]]:
        """Write ``request``; the future's result is (status, body, keep-alive). The reply must
        be complete by ``deadline`` (event-loop time; ``timeout`` names it in the error)."""
        assert self._transport is not None and self._reply is None
        loop = asyncio.get_running_loop()
        self._reply = loop.create_future()
        self._reset_message()
        self._received = 0
        self.ended_before_reply = False
        self._timeout = timeout
        self._timer = loop.call_at(deadline, self._deadline_passed)
        self._transport.write(request)
        return self._reply

    def abort(self) -> None:
        self._cancel_timer()
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio subclasses
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        if self._reply is None:  # bytes nobody asked for: the framing can no longer be trusted
            self.abort()
            return
        self._received += len(data)
        in_head = not self._headers_done
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, httpx.TransportError) else httpx.RemoteProtocolError(str(exc)))
            return
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(httpx.RemoteProtocolError(f"the engine's reply is not valid HTTP/1.1: {exc}"))
            return
        if in_head and not self._headers_done and self._reply is not None:
            self._head_bytes += len(data)  # the whole chunk belongs to the head
            if self._head_bytes > self._max_header_bytes:
                self._fail(self._head_too_large())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._reply is None:
            return
        self.ended_before_reply = self._received == 0
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

    def on_status(self, status: bytes) -> None:
        self._count_head(len(status) + 15)  # "HTTP/1.1 200 " + CRLF

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " + CRLF
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

    def _count_head(self, size: int) -> None:
        self._field_bytes += size
        if self._field_bytes > self._max_header_bytes:
            raise self._head_too_large()

    def _head_too_large(self) -> httpx.RemoteProtocolError:
        return httpx.RemoteProtocolError(f"the engine's reply headers exceed {self._max_header_bytes} bytes")

    def _finish(self) -> None:
        reply, self._reply = self._reply, None
        self._cancel_timer()
        if reply is not None and not reply.done():
            open_ = self._transport is not None and not self._transport.is_closing()
            reply.set_result((self._status, b"".join(self._chunks), self._keep_alive and open_))

    def _fail(self, error: httpx.TransportError) -> None:
        reply, self._reply = self._reply, None
        self.abort()
        if reply is not None and not reply.done():
            reply.set_exception(error)

    def _deadline_passed(self) -> None:
        self._timer = None
        self._fail(httpx.ReadTimeout(f"no complete reply from the engine within {self._timeout} s"))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
