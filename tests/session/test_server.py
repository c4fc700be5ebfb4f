"""The HTTP surface: routes, status codes, JSON errors, SSE, samples options, lifecycle."""

import asyncio
import json
import logging
import threading
import time

from miles_core.ci.register import register_cpu_ci
from miles_core.session import server
from miles_core.session.trajectory import SERVER_METADATA_KEYS

register_cpu_ci(est_time=8, suite="stage-a-cpu")

Q1 = {"role": "user", "content": "one"}


def _error(response, status, error_type):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == error_type
    return body["error"]["message"]


def test_health_and_lifecycle(serve) -> None:
    harness = serve("v1")
    health = harness.client.get("/health").json()
    assert health["status"] == "ok" and health["version"] == "v1"
    sid = harness.create()
    assert len(sid) == 32
    state = harness.state(sid).json()
    assert state["session_id"] == sid and state["records"] == []
    assert state["metadata"]["accumulated_token_ids"] == [] and state["metadata"]["template_family"] == "chatml"
    deleted = harness.client.delete(f"/sessions/{sid}")
    assert deleted.status_code == 204 and deleted.content == b""
    _error(harness.state(sid), 404, "not_found_error")


def test_unknown_session_is_404_on_every_route(serve) -> None:
    client = serve("v2").client
    for method, path in [
        ("GET", "/sessions/nope"),
        ("DELETE", "/sessions/nope"),
        ("POST", "/sessions/nope/v1/chat/completions"),
        ("POST", "/sessions/nope/samples"),
    ]:
        response = client.request(method, path, content=json.dumps({"messages": [Q1]}))
        assert "nope" in _error(response, 404, "not_found_error")


def test_routing_errors_are_json(serve) -> None:
    client = serve("v1").client
    _error(client.get("/no/such/path"), 404, "not_found_error")
    _error(client.get("/sessions"), 405, "method_not_allowed_error")
    _error(client.post("/sessions", content=b'{"extra": 1}'), 400, "invalid_request_error")


def test_request_body_limit(serve) -> None:
    harness = serve("v1", max_body_bytes=1000)
    sid = harness.create()
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    _error(harness.chat(sid, big), 413, "request_too_large_error")
    assert harness.state(sid).json()["records"] == []


def test_chat_reply_strips_replay_data_but_records_keep_it(serve) -> None:
    harness = serve("v1")
    sid = harness.create()
    reply = harness.chat(sid, {"messages": [Q1]}).json()
    meta = reply["choices"][0]["meta_info"]
    assert "routed_experts" not in meta and meta["output_token_logprobs"]
    record = harness.state(sid).json()["records"][0]
    assert record["response"]["choices"][0]["meta_info"]["routed_experts"] == "AAEC"
    sent = record["request"]
    assert sent["logprobs"] is True and sent["return_meta_info"] is True and sent["no_stop_trim"] is False
    assert sent["messages"] == [Q1] and "stream" not in sent


def test_forced_flags_cannot_be_overridden(serve) -> None:
    harness = serve("v1")
    sid = harness.create()
    body = {"messages": [Q1], "logprobs": False, "return_meta_info": False, "temperature": 0.5}
    assert harness.chat(sid, body).status_code == 200
    sent = json.loads(harness.stub.chat_requests(sid)[-1].body)
    assert sent["logprobs"] is True and sent["return_meta_info"] is True and sent["temperature"] == 0.5


def test_stream_is_answered_as_sse(serve) -> None:
    harness = serve("v2")
    sid = harness.create()
    response = harness.chat(sid, {"messages": [Q1], "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 3
    chunk, usage = json.loads(events[0]), json.loads(events[1])
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"]["content"].startswith("#1 ")
    assert chunk["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    sent = json.loads(harness.stub.chat_requests(sid)[-1].body)
    assert "stream" not in sent and "stream_options" not in sent


def test_samples_options(serve) -> None:
    harness = serve("v1")
    sid = harness.create()
    a1 = harness.chat(sid, {"messages": [Q1]}).json()["choices"][0]["message"]
    harness.chat(sid, {"messages": [Q1, a1, {"role": "user", "content": "two"}]})
    url = f"/sessions/{sid}/samples"
    full = harness.client.post(url, content=json.dumps({"metadata": {"reward": 1.0}})).json()
    [sample] = full["samples"]
    assert sample["metadata"]["reward"] == 1.0 and sample["metadata"]["turns"] == [1, 2]
    assert sample["status"] == "completed" and full["empty_reason"] is None
    first_len = len(harness.state(sid).json()["records"][0]["request"]["input_ids"])
    cut = harness.client.post(url, content=json.dumps({"max_seq_len": len(sample["tokens"]) - 1})).json()
    [short] = cut["samples"]
    assert short["metadata"]["turns"] == [1] and short["metadata"]["dropped_turns"] == 1
    assert short["status"] == "truncated" and short["prompt_length"] == first_len
    none = harness.client.post(url, content=json.dumps({"max_seq_len": 1})).json()
    assert none["samples"] == [] and none["empty_reason"] == "all_truncated"
    for bad in ({"max_seq_len": 0}, {"max_seq_len": "9"}, {"unknown": 1}, {"metadata": []}):
        _error(harness.client.post(url, content=json.dumps(bad)), 400, "invalid_request_error")
    for key in SERVER_METADATA_KEYS:
        message = _error(harness.client.post(url, content=json.dumps({"metadata": {key: 1}})), 400, "invalid_request_error")
        assert f"metadata.{key}" in message


def test_small_sessions_assemble_samples_inline_and_large_ones_in_a_worker(serve, monkeypatch) -> None:
    """Same reply either way; only sessions past INLINE_SAMPLES_TOKENS leave the event loop."""
    harness = serve("v2")
    sid = harness.create()
    a1 = harness.chat(sid, {"messages": [Q1]}).json()["choices"][0]["message"]
    harness.chat(sid, {"messages": [Q1, a1, {"role": "user", "content": "two"}]})
    committed = sum(turn["num_tokens"] for turn in harness.state(sid).json()["metadata"]["turns"])
    offloaded = []
    to_thread = asyncio.to_thread

    async def spy(fn, *args):
        offloaded.append(fn)
        return await to_thread(fn, *args)

    monkeypatch.setattr(server.asyncio, "to_thread", spy)
    url = f"/sessions/{sid}/samples"
    monkeypatch.setattr(server, "INLINE_SAMPLES_TOKENS", committed)
    inline = harness.client.post(url, content=b"{}")
    assert inline.status_code == 200 and offloaded == []
    monkeypatch.setattr(server, "INLINE_SAMPLES_TOKENS", committed - 1)
    in_worker = harness.client.post(url, content=b"{}")
    assert len(offloaded) == 1 and in_worker.content == inline.content


def test_delete_waits_for_the_generation_in_flight(serve) -> None:
    harness = serve("v1", stub_delay=0.4)
    sid = harness.create()
    replies = []
    chat = threading.Thread(target=lambda: replies.append(harness.chat(sid, {"messages": [Q1]})))
    chat.start()
    deadline = time.monotonic() + 5
    while harness.state(sid).json()["metadata"]["in_flight"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    late = threading.Thread(target=lambda: replies.append(harness.client.delete(f"/sessions/{sid}")))
    late.start()
    time.sleep(0.1)
    _error(harness.chat(sid, {"messages": [Q1]}), 409, "conflict_error")  # closing: no new turns
    chat.join()
    late.join()
    assert sorted(r.status_code for r in replies) == [200, 204]
    _error(harness.state(sid), 404, "not_found_error")


def test_the_parsed_request_is_let_go_while_the_engine_generates(serve) -> None:
    """An agent's whole conversation, parsed, is ~100 objects; kept for the seconds a generation
    takes, it is what every young garbage collection rescans (docs/session.md)."""
    import gc

    from miles_core.session.normalize import ChatRequest

    harness = serve("v1", stub_delay=0.5)
    sid = harness.create()
    chat = threading.Thread(target=lambda: harness.chat(sid, {"messages": [Q1]}))
    chat.start()
    deadline = time.monotonic() + 5
    while not harness.stub.chat_requests(sid):  # the engine has it: generating
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gc.collect()
    held = [o for o in gc.get_objects() if isinstance(o, ChatRequest)]
    chat.join()
    assert held == []


def test_max_sessions(serve) -> None:
    harness = serve("v1", max_sessions=2)
    ids = [harness.create(), harness.create()]
    _error(harness.client.post("/sessions"), 409, "conflict_error")
    harness.client.delete(f"/sessions/{ids[0]}")
    assert harness.create()


def test_head_and_method_errors(serve) -> None:
    client = serve("v1").client
    head = client.head("/health")
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"] == "application/json"
    assert "allowed: POST" in _error(client.get("/sessions"), 405, "method_not_allowed_error")
    _error(client.get("/sessions//samples"), 404, "not_found_error")
    _error(client.put("/sessions/abc"), 405, "method_not_allowed_error")


def test_an_internal_error_is_a_bounded_500_and_changes_nothing(tokenizer_dir, chat_tokenizer) -> None:
    """An exception that is not a session error (a bug) answers 500 JSON without the traceback;
    the server keeps serving."""
    import httpx

    from miles_core.plugins import MilesPluginManager
    from miles_core.session.config import SessionServerConfig
    from miles_core.session.embed import serve_in_thread
    from miles_core.testing.engine_stub import ScriptedChat, StubEngine
    from miles_core.testing.isolation import register_builtins

    class Broken:
        def __getattr__(self, name):
            return getattr(chat_tokenizer, name)

        def render_prompt(self, *args, **kwargs):
            raise RuntimeError("secret detail")

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    pm = MilesPluginManager()
    register_builtins(pm)
    log = Records()
    with StubEngine(ScriptedChat(chat_tokenizer)) as stub:
        config = SessionServerConfig(upstream_url=stub.url, tokenizer_dir=tokenizer_dir)
        with serve_in_thread(config, pm=pm, tokenizer=Broken()) as url, httpx.Client(base_url=url) as client:
            logging.getLogger("uvicorn.error").addHandler(log)
            try:
                sid = client.post("/sessions").json()["session_id"]
                reply = client.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": [Q1]})
                message = _error(reply, 500, "internal_error")
                assert "RuntimeError" in message and "secret" not in message
                assert client.get(f"/sessions/{sid}").json()["records"] == [] and stub.chat_requests() == []
            finally:
                logging.getLogger("uvicorn.error").removeHandler(log)
    assert any(r.exc_info and "secret detail" in str(r.exc_info[1]) for r in log.records)  # the traceback is logged


def test_a_reply_head_and_body_go_out_in_one_write() -> None:
    """The session server's uvicorn protocol joins each response's head and body into one send
    (one TCP segment, one wake-up of the client); a head without a body still goes out, and
    nothing is reordered."""
    import asyncio

    from miles_core.session.embed import _CoalescingTransport

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def close(self) -> None:
            self.closed = True

        def is_closing(self) -> bool:
            return self.closed

    async def run() -> Recorder:
        inner = Recorder()
        transport = _CoalescingTransport(inner)
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        transport.write(b"{}")
        assert inner.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
        transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")  # no body follows
        assert len(inner.writes) == 1
        await asyncio.sleep(0)
        assert inner.writes[-1] == b"HTTP/1.1 204 No Content\r\n\r\n"
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.close()  # flushes what it holds first
        assert inner.writes[-1] == b"HTTP/1.1 200 OK\r\n\r\n" and inner.closed and transport.is_closing()
        return inner

    assert len(asyncio.run(run()).writes) == 3


def test_head_requests_are_answered(serve) -> None:
    harness = serve("v1")
    response = harness.client.head("/health")
    assert response.status_code == 200 and response.content == b""
    assert harness.client.get("/health").json()["status"] == "ok"  # the connection is still in order


def test_waiting_connections_are_accepted_together_while_the_loop_is_busy() -> None:
    """Connections that wait while the event loop is busy are all served in the next few
    iterations, not one per iteration: uvloop's own server accepts one connection per
    iteration, so with 1,024 agents (iterations of 0.2-0.4 s) the last to connect waited ~20 s
    for their first turn. Measured in loop iterations (each ~5 ms of someone else's work)."""
    import socket

    from miles_core.session.embed import run_app_in_thread

    iterations = 0
    stop = False

    async def busy() -> None:  # every iteration of the loop runs ~5 ms of other work
        nonlocal iterations
        while not stop:
            time.sleep(0.005)
            iterations += 1
            await asyncio.sleep(0)

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await receive()
            task = asyncio.create_task(busy())
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await task
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = str(iterations).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def served_at(sock: socket.socket) -> int:
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.split(b"\r\n\r\n", 1)[1]:
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
        return int(reply.split(b"\r\n\r\n", 1)[1])

    agents = 40
    with run_app_in_thread(app) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        try:
            sockets = [socket.create_connection((host, int(port)), timeout=30) for _ in range(agents)]
            for sock in sockets:  # the kernel completed every handshake: all wait to be accepted
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            served = [served_at(sock) for sock in sockets]
            for sock in sockets:
                sock.close()
        finally:
            stop = True
    assert max(served) - min(served) < agents // 2, served  # one accept per iteration: >= 39


def test_forwarded_headers_do_not_rewrite_the_client() -> None:
    """The session server serves its app without uvicorn's proxy-headers middleware: an
    ``X-Forwarded-For`` from a loopback peer (which uvicorn trusts by default) leaves the client
    address as the connection's, and the request costs no pass over its headers."""
    import socket

    from miles_core.session.embed import run_app_in_thread

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = f"{scope['client'][0]} {scope['scheme']}".encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    with run_app_in_thread(app) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                b"GET /health HTTP/1.1\r\nhost: x\r\nx-forwarded-for: 203.0.113.7\r\nx-forwarded-proto: https\r\n\r\n"
            )
            reply = b""
            while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < int(
                reply.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]
            ):
                chunk = sock.recv(4096)
                assert chunk, reply
                reply += chunk
    assert reply.split(b"\r\n\r\n", 1)[1] == b"127.0.0.1 http"


def test_the_serving_process_collects_young_garbage_less_often(monkeypatch) -> None:
    """``serve_forever`` (the process of ``miles session serve``) freezes what is alive and
    raises the young generation's collection threshold before it serves; the older generations'
    thresholds stay as they were. Unless the environment sets it, the tokenizers library's
    thread pool is off."""
    import gc
    import os
    import socket

    from miles_core.session import embed

    seen: dict[str, object] = {}

    class Server:
        def run(self, sockets: list[socket.socket]) -> None:
            seen["threshold"] = gc.get_threshold()
            seen["frozen"] = gc.get_freeze_count()
            seen["parallelism"] = os.environ.get("TOKENIZERS_PARALLELISM")

    before = gc.get_threshold()
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)  # restored after the test
    monkeypatch.setattr(embed, "uvicorn_server", lambda app, **_: Server())
    try:
        gc.set_threshold(700, 10, 10)
        with socket.socket() as sock:
            embed.serve_forever(object(), sock)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    young, *older = seen["threshold"]  # type: ignore[misc]
    assert young >= 5_000 and older == [10, 10], seen
    assert isinstance(seen["frozen"], int) and seen["frozen"] > 0
    assert seen["parallelism"] == "false"  # the encoding that costs half (ChatTemplate.encode)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # a setting of the user's is kept
    try:
        with socket.socket() as sock:
            embed.serve_forever(object(), sock)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert seen["parallelism"] == "true"
