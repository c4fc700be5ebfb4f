"""HTTP transport of the session server: a small ASGI app (run it with uvicorn).

Routes (the public contract)::

    GET    /health
    POST   /sessions                              -> {"session_id"}
    GET    /sessions/{id}                         -> {"session_id", "records", "metadata"}
    DELETE /sessions/{id}                         -> 204
    POST   /sessions/{id}/v1/chat/completions     OpenAI chat; "stream": true answered as SSE
    POST   /sessions/{id}/samples                 -> {"session_id", "version", "samples", "empty_reason"}

Every error is JSON ``{"error": {"type", "message"}}`` with a bounded message and no stack trace.
Large replies (records; samples of sessions past :data:`INLINE_SAMPLES_TOKENS`) are serialized in
a worker thread so one long trajectory does not stall other sessions.

Six fixed routes need no framework: the app matches the path itself and answers from whole
bodies. (Starlette's middleware and routing layers cost more CPU per turn than the session
server's own JSON work, and kept ~10 extra coroutine frames per request alive for the garbage
collector to rescan.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_core.engine.client import ASGIApp, EngineClient
from miles_core.plugins import MilesPluginManager
from miles_core.session.base import PromptTokenizer, SessionVersion
from miles_core.session.config import SessionServerConfig
from miles_core.session.errors import (
    MethodNotAllowed,
    Misdirected,
    PayloadTooLarge,
    RouteNotFound,
    SessionError,
    bounded,
)
from miles_core.session.service import SessionService, activate_version, new_session_ids
from miles_core.session.upstream import HTTPUpstream, Upstream
from miles_core.strict_json import dumps

if TYPE_CHECKING:
    from miles_core.session.workers import Shard

logger = logging.getLogger("uvicorn.error")  # the server's log, configured by uvicorn (--log-level)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
JSON = b"application/json"
#: samples of a session with at most this many committed tokens are assembled on the event loop:
#: 32k tokens take ~1 ms (benchmarks/session_overhead.py), and for the short episodes of RL
#: rollouts the hand-off to a worker thread and back cost more than the work
INLINE_SAMPLES_TOKENS = 8192


def build_app(
    config: SessionServerConfig,
    *,
    pm: MilesPluginManager | None = None,
    tokenizer: PromptTokenizer | None = None,
    upstream_app: ASGIApp | None = None,
    upstream: Callable[[PromptTokenizer], Upstream] | None = None,
) -> SessionApp:
    """Activate the configured version and load the tokenizer now (fail fast), then return the
    app; the engine client lives from the app's startup to its shutdown.

    ``upstream_app``: the engine's ASGI app when it runs in this process; the session server
    then calls it directly instead of over HTTP (``config.upstream_url`` still names it in errors).
    ``upstream``: makes the :class:`~miles_core.session.upstream.Upstream` itself (given the
    tokenizer), e.g. an :class:`~miles_core.session.upstream.EngineUpstream` for an embedded
    engine in this process; ``config.upstream_url`` is then not used.
    """
    version = activate_version(config.version, pm)
    if tokenizer is None:
        tokenizer = load_tokenizer(config)
    return SessionApp(config, version, tokenizer, upstream_app, upstream)


def load_tokenizer(config: SessionServerConfig) -> PromptTokenizer:
    from miles_core.session.tokenizer import ChatTokenizer

    return ChatTokenizer.from_dir(config.tokenizer_dir, chat_template=config.chat_template, family=config.template_family)


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole HTTP reply (``content_type=None``: no body, as for 204)."""

    body: bytes = b""
    status: int = 200
    content_type: bytes | None = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()


class ClientDisconnected(Exception):
    """The client went away before its request body was read: nothing to answer."""


class SessionApp:
    """The ASGI app: lifespan (the engine client and the service) and the routes."""

    def __init__(
        self,
        config: SessionServerConfig,
        version: SessionVersion,
        tokenizer: PromptTokenizer,
        upstream_app: ASGIApp | None = None,
        upstream: Callable[[PromptTokenizer], Upstream] | None = None,
    ) -> None:
        self.config = config
        self.version = version
        self.tokenizer = tokenizer
        self.upstream_app = upstream_app
        self.make_upstream = upstream
        self.service: SessionService | None = None  # set at startup
        self.shard: Shard | None = None  # one worker of several: which (miles_core.session.workers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000, "reason": ""})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        config = self.config
        try:
            upstream: Upstream
            if self.make_upstream is not None:
                upstream = self.make_upstream(self.tokenizer)
            else:
                client = EngineClient(
                    config.upstream_url,
                    timeout=config.upstream_timeout,
                    connect_timeout=config.connect_timeout,
                    connect_retries=config.connect_retries,
                    headers=config.upstream_headers,
                    app=self.upstream_app,
                )
                upstream = HTTPUpstream(client, vocab_size=self.tokenizer.vocab_size)
        except Exception as exc:
            await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
            return
        shard = self.shard
        limits, session_ids = (config.limits, new_session_ids) if shard is None else (
            shard.limits(config.limits), shard.new_ids
        )
        self.service = SessionService(self.version, self.tokenizer, upstream, limits=limits, session_ids=session_ids)
        await send({"type": "lifespan.startup.complete"})
        try:
            await receive()  # lifespan.shutdown
        finally:
            await upstream.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            handler, session_id = route(scope["method"], scope["path"])
            if session_id and self.shard is not None and not self.shard.owns(session_id):
                raise Misdirected(
                    f"session {session_id[:64]!r} lives in another worker of this server and this request "
                    "could not be moved there (pipelined, or a request line over 64 KiB); send it on a new connection"
                )
            reply = await handler(self, session_id, scope, receive)
        except SessionError as exc:
            reply = error_reply(exc.status, exc.type, exc.message)
        except ClientDisconnected:
            return
        except Exception as exc:
            # A bug: the traceback goes to the server log, the client gets a bounded 500 and keeps
            # its connection (raising to uvicorn would close it, sometimes before the reply is read).
            logger.exception("Exception in ASGI application (%s %s)", scope["method"], scope["path"][:200])
            reply = error_reply(500, "internal_error", f"internal error ({type(exc).__name__}); see the server log")
        await send_reply(send, reply)

    # -- routes -------------------------------------------------------------------------------

    def _service(self) -> SessionService:
        if self.service is None:
            raise RuntimeError("the session app serves requests only between its lifespan startup and shutdown")
        return self.service

    async def health(self, session_id: str, scope: Scope, receive: Receive) -> Reply:
        return Reply(dumps(self._service().health()))

    async def create_session(self, session_id: str, scope: Scope, receive: Receive) -> Reply:
        body = await self._body(scope, receive)
        return Reply(dumps({"session_id": self._service().create(body)}))

    async def get_session(self, session_id: str, scope: Scope, receive: Receive) -> Reply:
        described = self._service().describe(session_id)
        return Reply(await asyncio.to_thread(dumps, described))

    async def delete_session(self, session_id: str, scope: Scope, receive: Receive) -> Reply:
        await self._service().delete(session_id)
        return Reply(status=204, content_type=None)

    async def chat_completions(self, session_id: str, scope: Scope, receive: Receive) -> Reply:
        outcome = await self._service().chat(session_id, await self._body(scope, receive))
        if outcome.stream:
            return Reply(
                sse_events(outcome.reply, include_usage=outcome.include_usage),
                content_type=b"text/event-stream; charset=utf-8",
                headers=((b"cache-control", b"no-cache"),),
            )
        return Reply(dumps(outcome.reply))

    async def samples(self, session_id: str, scope: Scope, receive: Receive) -> Reply:
        service = self._service()
        session, options = service.sample_job(session_id, await self._body(scope, receive))

        def encode() -> bytes:
            return dumps(service.assemble(session, options))

        if session.committed_tokens <= INLINE_SAMPLES_TOKENS:
            return Reply(encode())
        return Reply(await asyncio.to_thread(encode))

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        """The request body, refused with 413 past ``max_body_bytes`` (before reading it all)."""
        limit = self.config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise PayloadTooLarge(f"request body of {value.decode()} bytes exceeds max_body_bytes={limit}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds max_body_bytes={limit}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


Handler = Callable[[SessionApp, str, Scope, Receive], Awaitable[Reply]]

#: path shape -> {method: handler}; "*" stands for the session id
ROUTES: dict[tuple[str, ...], dict[str, Handler]] = {
    ("health",): {"GET": SessionApp.health},
    ("sessions",): {"POST": SessionApp.create_session},
    ("sessions", "*"): {"GET": SessionApp.get_session, "DELETE": SessionApp.delete_session},
    ("sessions", "*", "v1", "chat", "completions"): {"POST": SessionApp.chat_completions},
    ("sessions", "*", "samples"): {"POST": SessionApp.samples},
}


def route(method: str, path: str) -> tuple[Handler, str]:
    """The handler of ``method path`` and the session id in the path (``""`` if none)."""
    parts = tuple(path.split("/")[1:]) if path.startswith("/") else ()
    session_id = ""
    if len(parts) >= 2 and parts[0] == "sessions" and parts[1]:
        session_id, parts = parts[1], ("sessions", "*", *parts[2:])
    methods = ROUTES.get(parts)
    if methods is None:
        raise RouteNotFound(f"no route {method} {path[:200]}")
    handler = methods.get("GET" if method == "HEAD" else method)
    if handler is None:
        raise MethodNotAllowed(f"{method} is not allowed on {path[:200]} (allowed: {', '.join(methods)})")
    return handler, session_id


# -- encoding ---------------------------------------------------------------------------------


async def send_reply(send: Send, reply: Reply) -> None:
    headers = [*reply.headers]
    if reply.content_type is not None:
        headers += [(b"content-type", reply.content_type), (b"content-length", str(len(reply.body)).encode())]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


def error_reply(status: int, error_type: str, message: str) -> Reply:
    return Reply(dumps({"error": {"type": error_type, "message": bounded(message)}}), status=status)


def sse_events(reply: dict[str, Any], *, include_usage: bool) -> bytes:
    """The reply as ``chat.completion.chunk`` server-sent events: one chunk carrying the whole
    message, a usage chunk when asked for, then ``[DONE]``. Generation itself is not streamed."""
    header: dict[str, Any] = {k: reply[k] for k in ("id", "created", "model", "system_fingerprint") if k in reply}
    choices = []
    for choice in reply.get("choices") or ():
        delta = {k: v for k, v in (choice.get("message") or {}).items() if v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        chunk = {"index": choice.get("index", 0), "delta": delta, "logprobs": choice.get("logprobs")}
        chunk["finish_reason"] = choice.get("finish_reason")
        if "meta_info" in choice:
            chunk["meta_info"] = choice["meta_info"]
        choices.append(chunk)
    events = [{**header, "object": "chat.completion.chunk", "choices": choices}]
    if include_usage and "usage" in reply:
        events.append({**header, "object": "chat.completion.chunk", "choices": [], "usage": reply["usage"]})
    return b"".join(b"data: " + dumps(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"
