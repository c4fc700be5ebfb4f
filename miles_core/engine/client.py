"""Async HTTP client of an SGLang-compatible inference engine.

One client serves the session server (its upstream) and the RL loop. Each request has one
deadline (``timeout``) covering everything it does, retries included. It retries only failures
that prove the request never reached the engine (the TCP connection could not be established)
and, once, a request lost to the keep-alive race (a reused connection the engine closed before a
byte of reply; :meth:`~miles_core.engine.http.HTTPPool.exchange` argues why that is safe);
anything else -- a timeout, a reset mid-reply, a malformed reply -- is raised at once as a typed
:class:`EngineError`, because the engine may already be generating (and a retry would sample
again).

    async with EngineClient("http://127.0.0.1:30000", timeout=600) as engine:
        reply = await engine.chat_completions({"messages": [...], "input_ids": [...]},
                                              routing_key=session_id)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import httpx

from miles_core import __version__, strict_json
from miles_core.engine.errors import (
    EngineConnectionError,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeoutError,
)
from miles_core.engine.errors import (
    EngineError as EngineError,  # re-exported: the base of what the client raises
)
from miles_core.engine.http import HTTPPool

#: sticky-routing header understood by the SGLang model gateway (prefix-cache locality per session)
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
logger = logging.getLogger(__name__)

#: an ASGI application: ``await app(scope, receive, send)``
ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
    Awaitable[None],
]
#: how much of an error reply body an exception carries
SNIPPET_CHARS = 512
#: idle pooled connections are not reused after this long: under uvicorn's default 5 s (SGLang's
#: server), so the engine never closes a connection just as this client sends on it
KEEPALIVE_S = 4.0


def snippet(data: bytes | str, limit: int = SNIPPET_CHARS) -> str:
    """The first ``limit`` characters of ``data`` (decoded leniently), marked when cut."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more chars)"


class EngineClient:
    """Async client of one engine base URL (``http://host:port``, without ``/v1``).

    ``timeout`` bounds each call as a whole: waiting for a pooled connection, connecting (and
    retrying to), sending and reading the complete reply. ``connect_timeout`` bounds each attempt
    to establish a connection, which is retried ``connect_retries`` times with exponential backoff
    starting at ``retry_backoff`` seconds, all within ``timeout``. ``headers`` are sent with every
    request. At most ``max_connections`` connections are open at once.

    Requests go over :class:`~miles_core.engine.http.HTTPPool` (keep-alive connections, HTTP
    parsed in C by httptools): the per-request Python of httpx (~1 ms of CPU per engine call)
    and then of aiohttp (~0.4 ms) was the largest part of what the session server spent on a
    turn. ``transport`` replaces the network with an httpx transport (tests:
    ``httpx.MockTransport``); ``app`` calls an ASGI app of this process directly (an engine
    served in-process, such as :func:`miles_core.engine.server.create_app`): no sockets, no HTTP
    parsing, no hop through a server thread. All raise httpx's exception types, so everything above the byte exchange -- retries, typed
    errors, status and JSON checks -- is one code path.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        connect_retries: int = 2,
        retry_backoff: float = 0.05,
        headers: Mapping[str, str] | None = None,
        max_connections: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
        app: ASGIApp | None = None,
    ) -> None:
        if connect_retries < 0:
            raise ValueError(f"connect_retries must be >= 0, got {connect_retries}")
        if transport is not None and app is not None:
            raise ValueError("give at most one of transport and app")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_retries = connect_retries
        self.retry_backoff = retry_backoff
        default_headers = {"user-agent": f"miles/{__version__}", "accept": "application/json", **(headers or {})}
        self._pool: _Pool
        if app is not None:
            self._pool = _AppPool(app, self.base_url, default_headers)
        elif transport is not None:
            timeouts = httpx.Timeout(timeout, connect=connect_timeout)
            self._pool = _TransportPool(transport, self.base_url, default_headers, timeouts)
        else:
            self._pool = HTTPPool(
                self.base_url,
                headers=default_headers,
                timeout=timeout,
                connect_timeout=connect_timeout,
                max_connections=max_connections,
                keepalive_s=KEEPALIVE_S,
            )

    async def chat_completions(self, body: Mapping[str, Any], *, routing_key: str | None = None) -> dict[str, Any]:
        """``POST /v1/chat/completions``; the reply as a JSON object (not validated further)."""
        reply, _ = await self.chat_completions_raw(strict_json.dumps(body), routing_key=routing_key)
        return reply

    async def chat_completions_raw(
        self, content: bytes, *, routing_key: str | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """:meth:`chat_completions` for a body already encoded as JSON; the reply as a JSON object
        and as the exact bytes received (what the session server records)."""
        headers = _JSON_BODY if routing_key is None else {**_JSON_BODY, ROUTING_KEY_HEADER: routing_key}
        received = await self._send("POST", _CHAT_PATH, content=content, headers=headers)
        return _json_object(received, self.base_url + _CHAT_PATH), received

    async def health(self) -> dict[str, Any]:
        """``GET /health``: the reply's JSON object, or ``{}`` for an empty 2xx body (SGLang's)."""
        path = "/health"
        received = await self._send("GET", path)
        return _json_object(received, self.base_url + path) if received.strip() else {}

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict[str, Any]:
        """``POST /update_weights_from_disk`` with SGLang's body; the reply, whose ``success`` is true.

        The engine finishes the requests it is running first, so this can take as long as they
        do. A refusal (SGLang and the embedded engine answer 400 with their reason) raises
        :class:`EngineHTTPError`; a 2xx reply without ``"success": true`` raises
        :class:`EngineProtocolError`.
        """
        body: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        path = "/update_weights_from_disk"
        url = self.base_url + path
        received = await self._send("POST", path, content=json.dumps(body).encode(), headers=_JSON_BODY)
        reply = _json_object(received, url)
        if reply.get("success") is not True:
            raise EngineProtocolError(f"weight update answered without success: {snippet(received, 256)}", url=url)
        return reply

    async def weight_version(self) -> str:
        """``GET /get_weight_version``: the version of the weights the engine serves now."""
        path = "/get_weight_version"
        url = self.base_url + path
        reply = _json_object(await self._send("GET", path), url)
        version = reply.get("weight_version")
        if not isinstance(version, (str, int)) or isinstance(version, bool):
            raise EngineProtocolError(f"no weight_version in {snippet(json.dumps(reply), 128)}", url=url)
        return str(version)

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _send(
        self, method: str, path: str, *, content: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> bytes:
        """The body of a 2xx reply to one request, retried only while it provably never left."""
        url = self.base_url + path
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        attempt = 0
        while True:
            try:
                status, received = await self._pool.exchange(method, path, headers or {}, content, deadline=deadline)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nothing reached the engine: the only failure that is safe to retry.
                backoff = self.retry_backoff * 2**attempt
                if attempt >= self.connect_retries or loop.time() + backoff >= deadline:
                    kind = EngineTimeoutError if isinstance(exc, httpx.ConnectTimeout) else EngineConnectionError
                    raise kind(
                        f"cannot connect to the engine after {attempt + 1} attempt(s): {_describe(exc)}", url=url
                    ) from exc
                await asyncio.sleep(backoff)
                attempt += 1
            except httpx.TimeoutException as exc:
                raise EngineTimeoutError(f"engine timed out: {_describe(exc)}", url=url) from exc
            except httpx.TransportError as exc:
                raise EngineConnectionError(f"connection to the engine failed: {_describe(exc)}", url=url) from exc
        if not 200 <= status < 300:
            raise EngineHTTPError(status, snippet(received), url=url)
        return received


_JSON_BODY = {"content-type": "application/json"}
_CHAT_PATH = "/v1/chat/completions"


class _Pool(Protocol):
    """Sends one request and reads the whole reply by ``deadline`` (event-loop time); failures
    raise httpx's exception types."""

    async def exchange(
        self, method: str, path: str, headers: Mapping[str, str], content: bytes | None, *, deadline: float
    ) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...


class _TransportPool:
    """An httpx transport in place of the network (``EngineClient(transport=...)``)."""

    def __init__(
        self, transport: httpx.AsyncBaseTransport, base_url: str, headers: Mapping[str, str], timeout: httpx.Timeout
    ) -> None:
        self._transport = transport
        self._base_url = base_url
        self._headers = dict(headers)
        self._timeout = timeout.as_dict()

    async def exchange(
        self, method: str, path: str, headers: Mapping[str, str], content: bytes | None, *, deadline: float
    ) -> tuple[int, bytes]:
        request = httpx.Request(
            method, self._base_url + path, headers={**self._headers, **headers}, content=content, extensions={"timeout": self._timeout}
        )

        async def call() -> tuple[int, bytes]:
            response = await self._transport.handle_async_request(request)
            return response.status_code, await response.aread()

        return await _by_deadline(call(), deadline)

    async def aclose(self) -> None:
        await self._transport.aclose()


class _AppPool:
    """An ASGI app called in-process (``EngineClient(app=...)``) with one whole request.

    The app sees a client that stays connected until the whole reply is sent (then
    ``http.disconnect``). It must need no lifespan startup (the engine's app needs none).
    """

    def __init__(self, app: ASGIApp, base_url: str, headers: Mapping[str, str]) -> None:
        self._app = app
        self._base_url = base_url
        self._headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]

    async def exchange(
        self, method: str, path: str, headers: Mapping[str, str], content: bytes | None, *, deadline: float
    ) -> tuple[int, bytes]:
        # at the deadline the app is cancelled: the engine's app then aborts the generation
        return await _by_deadline(self._call(method, self._base_url + path, headers, content or b""), deadline)

    async def _call(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> tuple[int, bytes]:
        parts = urlsplit(url)
        request_headers = [
            *self._headers,
            *((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()),
            (b"host", parts.netloc.encode("latin-1")),
            (b"content-length", str(len(body)).encode()),
        ]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": parts.scheme,
            "path": unquote(parts.path),
            "raw_path": parts.path.encode("latin-1"),
            "query_string": parts.query.encode("latin-1"),
            "root_path": "",
            "headers": request_headers,
            "client": None,
            "server": (parts.hostname, parts.port),
        }
        replied = asyncio.Event()
        body_sent = False
        status, chunks = 0, []

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await replied.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    replied.set()

        try:
            await self._app(scope, receive, send)
        except Exception as exc:
            if not replied.is_set():
                raise httpx.RemoteProtocolError(f"the in-process app raised {type(exc).__name__}: {exc}") from exc
            # Starlette re-raises after sending its 500 reply; a server would log it, so do we
            logger.error("the in-process app raised after replying (%s %s)", method, url, exc_info=exc)
        if not replied.is_set():
            raise httpx.RemoteProtocolError("the in-process app returned without a complete reply")
        return status, b"".join(chunks)

    async def aclose(self) -> None:
        return None


async def _by_deadline(call: Awaitable[tuple[int, bytes]], deadline: float) -> tuple[int, bytes]:
    """``call``'s result, or :class:`httpx.ReadTimeout` once event-loop time passes ``deadline``."""
    remaining = deadline - asyncio.get_running_loop().time()
    try:
        return await asyncio.wait_for(call, max(remaining, 0.0))
    except TimeoutError:
        raise httpx.ReadTimeout(f"no complete reply within {max(remaining, 0.0):.3g} s") from None


def _json_object(content: bytes, url: str) -> dict[str, Any]:
    try:
        data = strict_json.loads(content)
    except ValueError as exc:
        raise EngineProtocolError(
            f"engine reply is not valid JSON ({_describe(exc)}): {snippet(content, 128)}", url=url
        ) from exc
    if not isinstance(data, dict):
        raise EngineProtocolError(f"engine reply is JSON {type(data).__name__}, expected an object", url=url)
    return data


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {snippet(text, 200)}" if text else type(exc).__name__
