"""HTTP front of the embedded engine (Starlette + uvicorn), SGLang-compatible.

Routes: ``POST /v1/chat/completions``, ``GET /health``, ``GET /v1/models``,
``GET /get_model_info``, ``GET /get_weight_version``, ``POST /update_weights_from_disk``.
Errors are JSON ``{"error": {"type", "message", "param"}}``: 400 for bad input (the field named),
500 for an engine failure; never a stack trace.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from miles_core.engine import protocol
from miles_core.engine.base import Completion, InvalidRequestError
from miles_core.engine.engine import Engine
from miles_core.engine.protocol import DEFAULT_MAX_TOKENS
from miles_core.errors import ConfigError

#: how often a waiting chat request checks whether its client went away
DISCONNECT_POLL_S = 0.25


def create_app(engine: Engine, *, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Starlette:
    async def chat_completions(request: Request) -> Response:
        req = protocol.parse(protocol.ChatCompletionRequest, await request.body())
        generation = protocol.to_generation_request(
            req, engine.tokenizer, default_max_tokens=default_max_tokens, room=engine.max_model_len
        )
        try:
            future = engine.submit(generation)
        except InvalidRequestError as exc:
            if exc.field == "input_ids" and req.input_ids is None:  # name what the client sent
                raise InvalidRequestError("messages", f"the rendered prompt is invalid: {exc.reason}") from None
            raise
        completion = await _result_unless_disconnected(request, engine, future)
        if completion is None:
            return Response(status_code=499)  # nobody reads it: the client went away
        body = protocol.chat_response(req, completion, engine.tokenizer, model=engine.name)
        if not req.stream:
            return JSONResponse(body)

        async def events() -> AsyncIterator[str]:
            yield f"data: {json.dumps(protocol.stream_chunk(body))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def update_weights_from_disk(request: Request) -> Response:
        try:
            req = protocol.parse(protocol.UpdateWeightsFromDiskRequest, await request.body())
            version = await asyncio.to_thread(engine.update_weights_from_disk, req.model_path, req.weight_version)
        except InvalidRequestError as exc:
            return JSONResponse(
                {"success": False, "message": str(exc), **protocol.error_body("invalid_request_error", str(exc), exc.field)},
                status_code=400,
            )
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to update model weights. Weight version updated to {version}.",
                "num_paused_requests": 0,
                "weight_version": version,
            }
        )

    async def health(request: Request) -> Response:
        problem = engine.problem
        body: dict[str, object] = {"status": "error" if problem else "ok", "model": engine.name, "weight_version": engine.weight_version, **engine.stats()}
        if problem:
            body["error"] = {"type": "engine_unavailable", "message": problem}
        return JSONResponse(body, status_code=503 if problem else 200)

    async def models(request: Request) -> Response:
        card = {"id": engine.name, "object": "model", "created": started, "owned_by": "miles", "max_model_len": engine.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def model_info(request: Request) -> Response:
        return JSONResponse(
            {"model_path": engine.name, "is_generation": True, "weight_version": engine.weight_version, "max_model_len": engine.max_model_len}
        )

    async def weight_version(request: Request) -> Response:
        return JSONResponse({"weight_version": engine.weight_version})

    async def bad_request(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InvalidRequestError)
        return JSONResponse(protocol.error_body("invalid_request_error", str(exc), exc.field), status_code=400)

    async def server_error(request: Request, exc: Exception) -> Response:
        return JSONResponse(protocol.error_body("internal_error", f"{type(exc).__name__}: {exc}"), status_code=500)

    started = int(time.time())
    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/get_model_info", model_info, methods=["GET"]),
            Route("/get_weight_version", weight_version, methods=["GET"]),
        ],
        exception_handlers={InvalidRequestError: bad_request, Exception: server_error},
    )


async def _result_unless_disconnected(request: Request, engine: Engine, future: Future[Completion]) -> Completion | None:
    """The completion, or ``None`` after aborting it because the client disconnected."""
    waiter = asyncio.wrap_future(future)
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
            if done:
                return waiter.result()
            if await request.is_disconnected():
                engine.abort(future)
                return None
    except asyncio.CancelledError:  # the server is shutting down
        engine.abort(future)
        raise


class EmbeddedServer:
    """The embedded engine behind uvicorn; an :class:`~miles_core.engine.base.EngineServer`.

    The listening socket is bound at construction (``port=0`` picks a free port), so
    :attr:`base_url` is known before serving. ``start()`` serves from a background thread (tests,
    ``miles train``); ``serve_forever()`` serves from the calling thread until SIGINT/SIGTERM
    (``miles engine serve``), then returns once the requests in flight are answered and the
    engine is closed; a second SIGINT meanwhile exits the process at once with status 130
    (:class:`~miles_core.uvicorn_signals.SignalStopped`).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        log_level: str = "warning",
    ) -> None:
        import uvicorn

        from miles_core.uvicorn_signals import signal_stopped_server

        self.engine = engine
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the
        # listening socket names TCP; without it each reply waits ~40 ms (Nagle + delayed ACK).
        self._socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
            self._socket.listen()  # connections queue from now on, before uvicorn starts serving
        except OSError as exc:
            self._socket.close()
            engine.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
        bound_host, bound_port = self._socket.getsockname()[:2]
        self.base_url = f"http://[{bound_host}]:{bound_port}" if family == socket.AF_INET6 else f"http://{bound_host}:{bound_port}"
        config = uvicorn.Config(
            create_app(engine, default_max_tokens=default_max_tokens), log_level=log_level, lifespan="off"
        )
        self._server = signal_stopped_server()(config)  # a signal ends serve_forever() as a return
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> EmbeddedServer:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="miles-engine-http", daemon=True
        )
        self._thread.start()
        self.wait_until_healthy(timeout)
        return self

    def serve_forever(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self.engine.close()

    def wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError("the engine HTTP server exited while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine HTTP server did not start within {timeout:.0f}s")
            time.sleep(0.01)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        return self.engine.update_weights_from_disk(model_path, weight_version)

    def shutdown(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self._socket.close()
        self.engine.close()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def launch_embedded(
    *,
    model_path: str | None = None,
    preset: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    **engine_options: Any,
) -> EmbeddedServer:
    """Build an engine from a model directory or a preset and serve it from a background thread."""
    from miles_core.engine.engine import EngineConfig

    if (model_path is None) == (preset is None):
        raise ConfigError("give exactly one of model_path or preset")
    config = EngineConfig(**engine_options)
    if preset is not None:
        engine = Engine.from_preset(preset, config)
    else:
        assert model_path is not None  # exactly one of the two: checked above
        engine = Engine.from_pretrained(model_path, config)
    return EmbeddedServer(engine, host=host, port=port, default_max_tokens=default_max_tokens).start()
