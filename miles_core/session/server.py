"""HTTP transport of the session server (Starlette; run it with uvicorn).

Routes (the public contract)::

    GET    /health
    POST   /sessions                              -> {"session_id"}
    GET    /sessions/{id}                         -> {"session_id", "records", "metadata"}
    DELETE /sessions/{id}                         -> 204
    POST   /sessions/{id}/v1/chat/completions     OpenAI chat; "stream": true answered as SSE
    POST   /sessions/{id}/samples                 -> {"session_id", "version", "samples", "empty_reason"}

Every error is JSON ``{"error": {"type", "message"}}`` with a bounded message and no stack trace.
Large replies (records, samples) are serialized in a worker thread so one long trajectory does
not stall other sessions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from miles_core.engine.client import EngineClient
from miles_core.plugins import MilesPluginManager, get_plugin_manager
from miles_core.session.base import PromptTokenizer, SessionVersion
from miles_core.session.config import SessionServerConfig
from miles_core.session.errors import PayloadTooLarge, SessionError, bounded
from miles_core.session.service import SessionService
from miles_core.strict_json import dumps

HTTP_ERROR_TYPES = {404: "not_found_error", 405: "method_not_allowed_error"}


def activate_version(name: str, pm: MilesPluginManager | None = None) -> SessionVersion:
    """The registered session version ``name``, verified (fails closed, naming the plugin)."""
    pm = pm or get_plugin_manager()
    contribution = pm.contribution("session", name)
    pm.verify(contribution, contribution.obj.verify)
    return contribution.obj


def build_app(
    config: SessionServerConfig,
    *,
    pm: MilesPluginManager | None = None,
    tokenizer: PromptTokenizer | None = None,
) -> Starlette:
    """Activate the configured version and load the tokenizer now (fail fast), then return the
    app; the engine client lives from the app's startup to its shutdown."""
    version = activate_version(config.version, pm)
    if tokenizer is None:
        from miles_core.session.tokenizer import ChatTokenizer

        tokenizer = ChatTokenizer.from_dir(
            config.tokenizer_dir, chat_template=config.chat_template, family=config.template_family
        )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with EngineClient(
            config.upstream_url,
            timeout=config.upstream_timeout,
            connect_timeout=config.connect_timeout,
            connect_retries=config.connect_retries,
            headers=config.upstream_headers,
        ) as engine:
            app.state.service = SessionService(version, tokenizer, engine, limits=config.limits)
            app.state.max_body_bytes = config.max_body_bytes
            yield

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/sessions", create_session, methods=["POST"]),
            Route("/sessions/{session_id}", get_session, methods=["GET"]),
            Route("/sessions/{session_id}", delete_session, methods=["DELETE"]),
            Route("/sessions/{session_id}/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/sessions/{session_id}/samples", samples, methods=["POST"]),
        ],
        exception_handlers={SessionError: session_error, HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )


# -- routes -----------------------------------------------------------------------------------


def _service(request: Request) -> SessionService:
    return request.app.state.service


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 past ``max_body_bytes`` (before reading it all)."""
    limit = request.app.state.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds max_body_bytes={limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds max_body_bytes={limit}")
        chunks.append(chunk)
    return b"".join(chunks)


async def health(request: Request) -> Response:
    return json_response(_service(request).health())


async def create_session(request: Request) -> Response:
    return json_response({"session_id": _service(request).create(await read_body(request))})


async def get_session(request: Request) -> Response:
    described = _service(request).describe(request.path_params["session_id"])
    return Response(await run_in_threadpool(dumps, described), media_type="application/json")


async def delete_session(request: Request) -> Response:
    await _service(request).delete(request.path_params["session_id"])
    return Response(status_code=204)


async def chat_completions(request: Request) -> Response:
    outcome = await _service(request).chat(request.path_params["session_id"], await read_body(request))
    if outcome.stream:
        return Response(
            sse_events(outcome.reply, include_usage=outcome.include_usage),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )
    return json_response(outcome.reply)


async def samples(request: Request) -> Response:
    service = _service(request)
    session, options = service.sample_job(request.path_params["session_id"], await read_body(request))
    body = await run_in_threadpool(lambda: dumps(service.assemble(session, options)))
    return Response(body, media_type="application/json")


# -- encoding and errors ------------------------------------------------------------------------


def json_response(data: Any, status_code: int = 200) -> Response:
    return Response(dumps(data), status_code=status_code, media_type="application/json")


def error_response(status_code: int, error_type: str, message: str) -> Response:
    return json_response({"error": {"type": error_type, "message": bounded(message)}}, status_code)


def sse_events(reply: dict[str, Any], *, include_usage: bool) -> bytes:
    """The reply as ``chat.completion.chunk`` server-sent events: one chunk carrying the whole
    message, a usage chunk when asked for, then ``[DONE]``. Generation itself is not streamed."""
    header = {k: reply[k] for k in ("id", "created", "model", "system_fingerprint") if k in reply}
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


async def session_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SessionError)
    return error_response(exc.status, exc.type, exc.message)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, HTTP_ERROR_TYPES.get(exc.status_code, "http_error"), str(exc.detail))


async def internal_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this reply, so the traceback reaches the server log.
    return error_response(500, "internal_error", f"internal error ({type(exc).__name__}); see the server log")
