"""The async engine client: typed errors, bounded bodies, retries only before a request left."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.client import (
    ROUTING_KEY_HEADER,
    EngineClient,
    EngineConnectionError,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeoutError,
)
from miles_core.testing.engine_stub import Fault, FixedReply, StubEngine, chat_reply

register_cpu_ci(est_time=13, suite="stage-a-cpu")

REPLY = chat_reply("r", {"role": "assistant", "content": "ok"}, [1, 2], "stop", prompt_tokens=3)


def _client(handler, **kwargs) -> EngineClient:
    return EngineClient("http://engine:1", transport=httpx.MockTransport(handler), retry_backoff=0.001, **kwargs)


def _run(coro):
    return asyncio.run(coro)


async def _chat(client: EngineClient, **kwargs):
    async with client:
        return await client.chat_completions({"input_ids": [1, 2, 3], "messages": []}, **kwargs)


def test_posts_compact_json_with_the_routing_key() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=REPLY)

    client = _client(handler, headers={"Authorization": "Bearer t"})
    assert _run(_chat(client, routing_key="s1")) == REPLY
    [request] = seen
    assert request.url.path == "/v1/chat/completions"
    assert request.headers[ROUTING_KEY_HEADER] == "s1" and request.headers["authorization"] == "Bearer t"
    assert request.content == b'{"input_ids":[1,2,3],"messages":[]}'


@pytest.mark.parametrize("error", [httpx.ConnectError("refused"), httpx.ConnectTimeout("slow connect")])
def test_connection_failures_are_retried(error) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) <= 2:
            raise error
        return httpx.Response(200, json=REPLY)

    assert _run(_chat(_client(handler, connect_retries=2))) == REPLY
    assert len(calls) == 3
    calls.clear()
    expected = EngineTimeoutError if isinstance(error, httpx.ConnectTimeout) else EngineConnectionError
    with pytest.raises(expected, match="after 2 attempt"):
        _run(_chat(_client(handler, connect_retries=1)))
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (httpx.ReadTimeout("read"), EngineTimeoutError),
        (httpx.WriteTimeout("write"), EngineTimeoutError),
        (httpx.RemoteProtocolError("peer closed"), EngineConnectionError),
        (httpx.ReadError("reset"), EngineConnectionError),
    ],
)
def test_failures_after_sending_are_never_retried(error, expected) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise error

    with pytest.raises(expected):
        _run(_chat(_client(handler, connect_retries=5)))
    assert len(calls) == 1


def test_http_errors_carry_a_bounded_snippet() -> None:
    client = _client(lambda request: httpx.Response(503, content=b"overloaded " + b"x" * 5000))
    with pytest.raises(EngineHTTPError) as info:
        _run(_chat(client))
    assert info.value.status_code == 503
    assert info.value.body_snippet.startswith("overloaded") and len(info.value.body_snippet) < 600
    assert "http://engine:1/v1/chat/completions" in str(info.value)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"choices": [', "not valid JSON"),
        (b"[1, 2]", "JSON list, expected an object"),
        (b'{"x": NaN}', "NaN"),
        (b'{"x": "\\udc00"}', "surrogate"),
    ],
)
def test_malformed_replies_are_protocol_errors(body, expected) -> None:
    with pytest.raises(EngineProtocolError, match=expected):
        _run(_chat(_client(lambda request: httpx.Response(200, content=body))))


def test_health_accepts_sglangs_empty_body() -> None:
    async def probe(body: bytes):
        async with _client(lambda request: httpx.Response(200, content=body)) as client:
            return await client.health()

    assert _run(probe(b"")) == {}
    assert _run(probe(b'{"status": "ok"}')) == {"status": "ok"}


def test_against_a_real_socket() -> None:
    """Timeouts, resets and refused connections over loopback, against the stub engine."""
    with StubEngine(FixedReply(REPLY)) as stub:

        async def scenario():
            async with EngineClient(
                stub.url, timeout=0.3, connect_retries=2, retry_backoff=0.001, headers={"Authorization": "Bearer t"}
            ) as client:
                assert (await client.chat_completions({"input_ids": [1]}, routing_key="s1"))["id"] == "r"
                [sent] = stub.chat_requests()
                assert sent.body == b'{"input_ids":[1]}' and "accept-encoding" not in sent.headers
                assert sent.headers["content-type"] == "application/json" and sent.headers["authorization"] == "Bearer t"
                assert sent.headers[ROUTING_KEY_HEADER.lower()] == "s1" and sent.headers["user-agent"].startswith("miles/")
                stub.inject(Fault.TIMEOUT)
                with pytest.raises(EngineTimeoutError):
                    await client.chat_completions({"input_ids": [1]})
                stub.inject(Fault.RESET)
                with pytest.raises(EngineConnectionError):
                    await client.chat_completions({"input_ids": [1]})
                assert json.loads(stub.chat_requests()[-1].body) == {"input_ids": [1]}

        _run(scenario())
        assert len(stub.chat_requests()) == 3  # a request that reached the engine is never sent again
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def refused():
        async with EngineClient(f"http://127.0.0.1:{port}", connect_retries=1, retry_backoff=0.001) as client:
            await client.health()

    with pytest.raises(EngineConnectionError, match="after 2 attempt"):
        _run(refused())


def test_weight_update_and_version_against_the_embedded_engine(tiny_dir, tmp_path) -> None:
    from safetensors.torch import save_file

    from miles_core.engine.engine import Engine, EngineConfig
    from miles_core.engine.server import EmbeddedServer

    async def scenario(url: str) -> tuple[dict, str, EngineHTTPError]:
        async with EngineClient(url) as client:
            reply = await client.update_weights_from_disk(str(tmp_path), "step-1")
            version = await client.weight_version()
            with pytest.raises(EngineHTTPError) as refused:
                await client.update_weights_from_disk(str(tmp_path / "missing"), "step-2")
            return reply, version, refused.value

    with EmbeddedServer(Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=1))) as server:
        server.start()
        weights = {n: p.detach().clone().contiguous() for n, p in server.engine.model.named_parameters()}
        save_file(weights, str(tmp_path / "model.safetensors"))
        reply, version, refused = _run(scenario(server.base_url))
        assert server.engine.weight_version == "step-1"
    assert reply["success"] is True and version == "step-1"
    assert refused.status_code == 400 and "model_path" in refused.body_snippet


@pytest.mark.parametrize(
    "path, body, message",
    [("/update_weights_from_disk", {"success": False, "message": "no"}, "without success"),
     ("/get_weight_version", {"version": "1"}, "no weight_version")],
)
def test_weight_replies_that_break_the_contract_are_protocol_errors(path: str, body: dict, message: str) -> None:
    client = _client(lambda request: httpx.Response(200, json=body))

    async def call():
        async with client:
            if path == "/get_weight_version":
                return await client.weight_version()
            return await client.update_weights_from_disk("/ckpt")

    with pytest.raises(EngineProtocolError, match=message):
        _run(call())


def _asgi_app(reply: bytes = b'{"id": "r"}', status: int = 200, *, fail: Exception | None = None,
              fail_after_reply: bool = False, hang: asyncio.Event | None = None, seen: list | None = None):
    """A small ASGI app: records what it was sent, then replies, raises or hangs."""

    async def app(scope, receive, send):
        message = await receive()
        if seen is not None:
            seen.append((scope, message["body"]))
        if hang is not None:
            try:
                await asyncio.sleep(60)
            finally:
                hang.set()  # cancelled by the client's timeout
        if fail is not None and not fail_after_reply:
            raise fail
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": reply[:3], "more_body": True})
        await send({"type": "http.response.body", "body": reply[3:]})
        if fail is not None:
            raise fail

    return app


def test_an_in_process_app_gets_the_request_a_server_would_parse() -> None:
    seen: list = []

    async def scenario():
        async with EngineClient("http://engine:7/base", app=_asgi_app(seen=seen), headers={"Authorization": "Bearer t"}) as client:
            reply, raw = await client.chat_completions_raw(b'{"input_ids":[1]}', routing_key="s1")
            assert reply == {"id": "r"} and raw == b'{"id": "r"}'  # chunks joined, bytes as sent

    _run(scenario())
    [(scope, body)] = seen
    headers = dict(scope["headers"])
    assert body == b'{"input_ids":[1]}' and scope["method"] == "POST" and scope["path"] == "/base/v1/chat/completions"
    assert headers[b"content-length"] == b"17" and headers[b"host"] == b"engine:7"
    assert headers[b"authorization"] == b"Bearer t" and headers[ROUTING_KEY_HEADER.lower().encode()] == b"s1"


def test_in_process_failures_map_like_network_ones(caplog) -> None:
    async def chat(app, **kwargs):
        async with EngineClient("http://engine:1", app=app, **kwargs) as client:
            return await client.chat_completions({"input_ids": [1]})

    with pytest.raises(EngineHTTPError, match="HTTP 400") as refused:
        _run(chat(_asgi_app(b'{"error": "bad"}', 400)))
    assert refused.value.status_code == 400
    calls: list = []
    with pytest.raises(EngineConnectionError, match="RuntimeError: boom"):
        _run(chat(_asgi_app(fail=RuntimeError("boom"), seen=calls), connect_retries=3))
    assert len(calls) == 1  # it reached the engine: never sent again
    # Starlette re-raises a handler's exception after sending its 500: the reply stands, the error is logged
    with pytest.raises(EngineHTTPError, match="HTTP 500"):
        _run(chat(_asgi_app(b'{"error": "internal"}', 500, fail=RuntimeError("late"), fail_after_reply=True)))
    assert "raised after replying" in caplog.text and "late" in caplog.text
    with pytest.raises(EngineProtocolError):
        _run(chat(_asgi_app(b"not json")))

    async def timed_out():
        cancelled = asyncio.Event()
        with pytest.raises(EngineTimeoutError, match=r"no complete reply within 0\.05 s"):
            await chat(_asgi_app(hang=cancelled), timeout=0.05)
        assert cancelled.is_set()  # the app was cancelled (the engine's app then aborts the generation)

    _run(timed_out())
    with pytest.raises(ValueError, match="at most one of transport and app"):
        EngineClient("http://engine:1", app=_asgi_app(), transport=httpx.MockTransport(lambda r: httpx.Response(200)))


async def _ok_app(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"id": "r"}'})


def test_a_busy_loop_does_not_reuse_a_connection_the_engine_closed_meanwhile() -> None:
    """uvicorn closes an idle connection after timeout_keep_alive; an event loop busy past it
    has not seen the close when it sends the next request."""
    from miles_core.session.embed import run_app_in_thread

    with run_app_in_thread(_ok_app, keep_alive_s=0.2) as url:

        async def scenario() -> None:
            async with EngineClient(url, timeout=5, connect_retries=0) as client:
                assert await client.chat_completions({"input_ids": [1]}) == {"id": "r"}
                time.sleep(0.4)  # the loop is busy (a long tokenization, a GC pause) past the keep-alive
                assert await client.chat_completions({"input_ids": [1]}) == {"id": "r"}

        _run(scenario())


def test_requests_racing_the_engines_keep_alive_timer_all_succeed() -> None:
    """Requests sent by a busy loop about when the engine's keep-alive timer closes the idle
    connection -- just before, at or after it: every request must still get its reply."""
    from miles_core.session.embed import run_app_in_thread

    with run_app_in_thread(_ok_app, keep_alive_s=0.05) as url:

        async def scenario() -> int:
            ok = 0
            async with EngineClient(url, timeout=5, connect_retries=0) as client:
                for i in range(30):
                    time.sleep(0.05 * (0.9 + 0.2 * (i % 11) / 10))  # busy for 45-55 ms
                    ok += await client.chat_completions({"input_ids": [1]}) == {"id": "r"}
            return ok

        assert _run(scenario()) == 30


def test_the_timeout_bounds_a_trickling_reply() -> None:
    """A peer that sends one byte at a time, each within the timeout, is cut off at the deadline."""

    async def scenario() -> float:
        async def trickle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
            try:
                for _ in range(1000):
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(0.03)
            except ConnectionError:
                pass

        server = await asyncio.start_server(trickle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with EngineClient(f"http://127.0.0.1:{port}", timeout=0.3) as client:
            with pytest.raises(EngineTimeoutError, match="no complete reply"):
                await client.health()
        server.close()
        return loop.time() - started

    assert _run(scenario()) < 0.3 + 0.2  # the deadline, plus scheduling on a loaded machine
