"""The engine client's HTTP/1.1 pool against scripted loopback servers: what it sends, how it
frames and reuses connections, and which httpx error each failure becomes."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import httpx
import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.http import HTTPPool

register_cpu_ci(est_time=7, suite="stage-a-cpu")

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LOOPS: list[Callable[[], asyncio.AbstractEventLoop] | None] = [None]
try:
    import uvloop

    LOOPS.append(uvloop.new_event_loop)
except ImportError:  # uvloop is not installed on Windows
    pass
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head (without the blank line) and body; ``(b"", b"")`` at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b"", b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head[:-4], await reader.readexactly(length)


class Server:
    """A loopback server running ``handler`` per connection (by default :meth:`keep_alive`);
    counts connections and records the requests :meth:`keep_alive` answered."""

    def __init__(
        self, handler: Handler | None = None, *, replies: tuple[bytes, ...] = (OK,), tls: ssl.SSLContext | None = None
    ) -> None:
        self.handler = handler or self.keep_alive
        self.replies = replies
        self.tls = tls
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []

    async def __aenter__(self) -> Server:
        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass  # the client went away: what some tests are about
            finally:
                writer.close()

        self._server = await asyncio.start_server(on_connection, "127.0.0.1", 0, ssl=self.tls)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()

    async def keep_alive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer successive requests with ``replies`` (the last repeats) until the client closes."""
        while True:
            request = await read_request(reader)
            if not request[0]:
                return
            self.requests.append(request)
            writer.write(self.replies[min(len(self.requests), len(self.replies)) - 1])
            await writer.drain()


def answer(reply: bytes, *, then: Literal["wait", "close", "reset"] = "wait") -> Handler:
    """Read one request, write ``reply``, then keep the connection open, close it or reset it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        if then == "reset":  # a zero linger time makes the close a TCP reset
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        elif then == "wait":
            await asyncio.sleep(5)
        # "close": returning lets the server close the connection

    return handler


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    await asyncio.sleep(5)


def pool(url: str, **kwargs) -> HTTPPool:
    settings = {"headers": {"user-agent": "test"}, "timeout": 2.0, "connect_timeout": 1.0, "max_connections": 8, "keepalive_s": 60.0}
    return HTTPPool(url, **{**settings, **kwargs})


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    """On asyncio's loop and on uvloop's (what uvicorn runs the session server on)."""
    for loop_factory in LOOPS:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(asyncio.wait_for(scenario(), 20))


def test_requests_are_exact_and_connections_are_kept_alive() -> None:
    async def scenario() -> None:
        async with Server(replies=(OK, b"HTTP/1.1 201 Created\r\ncontent-length: 3\r\n\r\nnew")) as server:
            client = pool(server.url + "/prefix/", headers={"user-agent": "test", "authorization": "Bearer t"})
            assert await client.exchange("POST", "/v1/chat", {"x-key": "s1"}, b'{"a":1}') == (200, b"ok")
            assert await client.exchange("GET", "/health", {}, None) == (201, b"new")
            await client.aclose()
        assert server.connections == 1
        port = server.url.rsplit(":", 1)[1]
        assert server.requests[0] == (
            f"POST /prefix/v1/chat HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nuser-agent: test\r\n"
            f"authorization: Bearer t\r\nx-key: s1\r\ncontent-length: 7".encode(),
            b'{"a":1}',
        )
        assert server.requests[1][0].startswith(b"GET /prefix/health HTTP/1.1\r\n")
        assert b"content-length" not in server.requests[1][0]

    run(scenario)


@pytest.mark.parametrize(
    ("reply", "reused"),
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", True),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nabcde", True),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nabcde", False),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\nabcde", False),
    ],
    ids=["chunked", "informational-first", "connection-close", "http-1.0"],
)
def test_reply_framing_and_when_a_connection_is_reused(reply: bytes, reused: bool) -> None:
    async def scenario() -> None:
        async with Server(replies=(reply,)) as server:
            client = pool(server.url)
            for _ in range(2):
                assert await client.exchange("GET", "/", {}, None) == (200, b"abcde")
            await client.aclose()
        assert server.connections == (1 if reused else 2)

    run(scenario)


def test_a_body_delimited_by_the_connection_end() -> None:
    async def scenario() -> None:
        async with Server(answer(b"HTTP/1.1 200 OK\r\n\r\nuntil the end", then="close")) as server:
            client = pool(server.url)
            assert await client.exchange("GET", "/", {}, None) == (200, b"until the end")
            assert await client.exchange("GET", "/", {}, None) == (200, b"until the end")
            await client.aclose()
        assert server.connections == 2

    run(scenario)


def test_stale_and_closed_idle_connections_are_replaced() -> None:
    async def scenario() -> None:
        async with Server(answer(OK, then="close")) as server:
            client = pool(server.url)
            for _ in range(3):
                assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
                await asyncio.sleep(0.05)  # the close reaches the idle connection
            await client.aclose()
        assert server.connections == 3
        async with Server() as server:
            client = pool(server.url, keepalive_s=0.05)
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
            await asyncio.sleep(0.1)  # idle past keepalive_s: the engine may be closing it
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
            await client.aclose()
        assert server.connections == 2

    run(scenario)


def test_unsolicited_bytes_drop_the_idle_connection() -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await read_request(reader))[0]:
            writer.write(OK + b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nlate")
            await writer.drain()

    async def scenario() -> None:
        async with Server(chatty) as server:
            client = pool(server.url)
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
            await asyncio.sleep(0.05)
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")  # not b"late"
            await client.aclose()
        assert server.connections == 2

    run(scenario)


@pytest.mark.parametrize(
    ("handler", "settings", "error", "message"),
    [
        (answer(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nabc", then="reset"), {}, httpx.ReadError, "broke"),
        (answer(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nabc"), {"timeout": 0.2}, httpx.ReadTimeout, "no complete reply"),
        (answer(b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n" + b"x" * 99), {"max_reply_bytes": 64}, httpx.RemoteProtocolError, "exceeds 64"),
        (answer(b"SMTP ready\r\n\r\n"), {}, httpx.RemoteProtocolError, "not valid HTTP"),
        (_silent, {"timeout": 0.2}, httpx.ReadTimeout, "no complete reply"),
    ],
    ids=["reset-mid-body", "stalled-body", "oversized", "not-http", "no-reply"],
)
def test_failures_after_sending_raise_what_they_prove(handler, settings, error, message) -> None:
    async def scenario() -> None:
        async with Server(handler) as server:
            client = pool(server.url, **settings)
            with pytest.raises(error, match=message) as raised:
                await client.exchange("POST", "/", {}, b"{}")
            assert not isinstance(raised.value, (httpx.ConnectError, httpx.ConnectTimeout))  # never retried
            await client.aclose()

    run(scenario)


def test_an_early_close_is_a_protocol_error() -> None:
    async def scenario() -> None:
        async with Server(answer(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nabc", then="close")) as server:
            client = pool(server.url)
            with pytest.raises(httpx.RemoteProtocolError, match="without a complete reply"):
                await client.exchange("GET", "/", {}, None)
            await client.aclose()

    run(scenario)


def test_the_timeout_bounds_the_whole_exchange() -> None:
    """A peer that keeps sending a byte at a time cannot hold a request past its timeout."""

    async def dripping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
        for _ in range(100):
            await asyncio.sleep(0.02)
            writer.write(b"x")
            await writer.drain()

    async def scenario() -> None:
        async with Server(dripping) as server:
            client = pool(server.url, timeout=0.3)  # the whole reply would take ~2 s
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(httpx.ReadTimeout, match=r"no complete reply from the engine within 0\.3 s"):
                await client.exchange("GET", "/", {}, None)
            assert loop.time() - started < 0.3 + 0.2  # the deadline, plus scheduling on a loaded machine
            await client.aclose()

    run(scenario)


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (100 << 10) + b"\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 90) for i in range(1000)) + b"content-length: 0\r\n\r\n",
    ],
    ids=["one-huge-header", "many-headers"],
)
def test_reply_headers_are_capped(reply: bytes) -> None:
    async def scenario() -> None:
        async with Server(answer(reply)) as server:
            client = pool(server.url)
            with pytest.raises(httpx.RemoteProtocolError, match="headers exceed 65536 bytes"):
                await client.exchange("GET", "/", {}, None)
            small = pool(server.url, max_header_bytes=len(reply))  # under its own cap the same reply passes
            status, _ = await small.exchange("GET", "/", {}, None)
            assert status == 200
            await client.aclose()
            await small.aclose()

    run(scenario)


def test_headers_trickled_past_the_cap_are_refused_before_they_end() -> None:
    async def endless_header(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-endless: ")
        for _ in range(400):  # 400 x 1 KiB, never a line end
            writer.write(b"a" * 1024)
            await writer.drain()
            await asyncio.sleep(0)

    async def scenario() -> None:
        async with Server(endless_header) as server:
            client = pool(server.url, max_header_bytes=16 << 10)
            with pytest.raises(httpx.RemoteProtocolError, match="headers exceed 16384 bytes"):
                await client.exchange("GET", "/", {}, None)
            await client.aclose()

    run(scenario)


async def _end_on_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, how: str = "close") -> None:
    """Read a request and end the connection without a byte of reply: closed, reset, or after
    a partial reply."""
    await read_request(reader)
    if how == "reset":
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    elif how == "partial":
        writer.write(b"HTTP/1.1 200 OK\r\n")
        await writer.drain()


def _racing_server(first: str, second: str) -> Server:
    """Connection 1 serves one reply, then ends on the next request as ``first`` says;
    connection 2 ends on its first request as ``second`` says ("serve": keep-alive as usual)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if server.connections == 1:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()
            await _end_on_request(reader, writer, first)
        elif server.connections == 2 and second != "serve":
            await _end_on_request(reader, writer, second)
        else:
            await server.keep_alive(reader, writer)

    server = Server(handler)
    return server


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_reused_connection_that_ends_before_any_reply_byte_is_retried_once(how: str) -> None:
    """The keep-alive race: the engine ended the idle connection as the request reached it."""

    async def scenario() -> None:
        async with _racing_server(how, "serve") as server:
            client = pool(server.url)
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
            assert await client.exchange("POST", "/", {}, b"{}") == (200, b"ok")  # retried on connection 2
            await client.aclose()
        assert server.connections == 2 and server.requests == [(server.requests[0][0], b"{}")]

    run(scenario)


@pytest.mark.parametrize(
    ("first", "second", "error", "connections"),
    [
        ("partial", "serve", httpx.RemoteProtocolError, 1),  # a reply had begun: the engine was answering
        ("close", "close", httpx.RemoteProtocolError, 2),  # one retry, and a fresh connection that ends stands
        ("close", "reset", httpx.ReadError, 2),
    ],
    ids=["reply-begun", "retry-ends-too", "retry-reset"],
)
def test_what_is_never_retried(first: str, second: str, error: type[Exception], connections: int) -> None:
    async def scenario() -> None:
        async with _racing_server(first, second) as server:
            client = pool(server.url)
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
            with pytest.raises(error):
                await client.exchange("POST", "/", {}, b"{}")
            await client.aclose()
        assert server.connections == connections

    run(scenario)


def test_a_fresh_connection_that_ends_before_a_reply_is_not_retried() -> None:
    async def scenario() -> None:
        async with Server(_end_on_request) as server:
            client = pool(server.url)
            with pytest.raises(httpx.RemoteProtocolError, match="without a complete reply"):
                await client.exchange("POST", "/", {}, b"{}")
            await client.aclose()
        assert server.connections == 1

    run(scenario)


def test_an_idle_connection_the_peer_closed_is_not_reused_even_before_the_loop_sees_it() -> None:
    """The engine's close can sit unread in the socket while this event loop is busy: the
    transport still looks open, the socket says otherwise."""

    async def scenario() -> None:
        async with Server(answer(OK, then="close")) as server:
            client = pool(server.url)
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
            [idle] = client._idle
            time.sleep(0.1)  # blocks the loop: the close arrives, connection_lost has not run
            assert not idle._transport.is_closing()
            assert not idle.reusable()
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
            await client.aclose()
        assert server.connections == 2

    run(scenario)


def test_connection_failures_are_connect_errors() -> None:
    async def scenario() -> None:
        async with Server(_silent) as server:
            url = server.url
        with pytest.raises(httpx.ConnectError, match="cannot connect"):
            await pool(url).exchange("GET", "/", {}, None)

    run(scenario)


def test_the_connection_limit_queues_requests_and_bounds_the_wait() -> None:
    delays = [0.1]

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await read_request(reader))[0]:
            await asyncio.sleep(delays[0])
            writer.write(OK)
            await writer.drain()

    async def scenario() -> None:
        async with Server(slow) as server:
            client = pool(server.url, max_connections=1)
            replies = await asyncio.gather(*(client.exchange("GET", "/", {}, None) for _ in range(3)))
            assert replies == [(200, b"ok")] * 3 and server.connections == 1
            await client.aclose()
            # the wait for a slot counts against the request's deadline
            delays[0] = 0.3
            client = pool(server.url, max_connections=1, timeout=0.15)
            later = asyncio.get_running_loop().time() + 2  # a caller's own deadline for the first
            first = asyncio.ensure_future(client.exchange("GET", "/", {}, None, deadline=later))
            await asyncio.sleep(0.01)
            with pytest.raises(httpx.ConnectTimeout, match="no free connection"):
                await asyncio.gather(*(client.exchange("GET", "/", {}, None) for _ in range(2)))
            assert await first == (200, b"ok")
            await client.aclose()

    run(scenario)


def test_a_cancelled_request_closes_its_connection_and_frees_its_slot() -> None:
    async def scenario() -> None:
        closed = asyncio.Event()

        async def hang_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if server.connections == 1:
                await read_request(reader)
                await reader.read()  # returns at EOF: the client closed the connection
                closed.set()
                return
            await server.keep_alive(reader, writer)

        async with Server(hang_then_answer) as server:
            client = pool(server.url, max_connections=1)
            request = asyncio.ensure_future(client.exchange("GET", "/", {}, None))
            await asyncio.sleep(0.05)
            request.cancel()
            await asyncio.wait_for(closed.wait(), 2)
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
            await client.aclose()

    run(scenario)


def test_header_injection_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        pool("http://127.0.0.1:1", headers={"x": "a\r\nhost: evil"})

    async def scenario() -> None:
        with pytest.raises(ValueError, match="line break"):
            await pool("http://127.0.0.1:1").exchange("GET", "/", {"x-key": "s\n1"}, None)

    run(scenario)
    with pytest.raises(ValueError, match="http:// or https://"):
        pool("ftp://engine")


def test_a_pool_without_connections_is_refused() -> None:
    with pytest.raises(ValueError, match="max_connections must be >= 1, got 0"):
        pool("http://127.0.0.1:1", max_connections=0)


def test_tls() -> None:
    trustme = pytest.importorskip("trustme")
    authority = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(server_context)

    async def scenario() -> None:
        async with Server(tls=server_context) as server:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await pool(server.url).exchange("GET", "/", {}, None)  # the system CAs do not know it
            trusting = ssl.create_default_context()
            authority.configure_trust(trusting)
            client = pool(server.url, tls=trusting)
            assert await client.exchange("GET", "/", {}, None) == (200, b"ok")
            await client.aclose()

    run(scenario)
