"""A deterministic SGLang-compatible engine stub on a loopback port, with fault injection.

It speaks the upstream contract of the session server -- ``POST /v1/chat/completions`` with
``input_ids``, replies carrying ``choices[0].meta_info.output_token_logprobs`` and
``completion_tokens`` -- and records every request's exact bytes. It is an asyncio server on
``h11`` rather than an ASGI app so it can also misbehave at the connection level (reset a
connection, never answer). Used by the session tests and ``benchmarks/session_overhead.py``::

    with StubEngine(ScriptedChat(tokenizer)) as stub:
        stub.inject(Fault.STATUS_500)     # the next chat request fails that way
        ...                               # point a session server at stub.url
        stub.requests                     # [StubRequest(method, path, headers, body), ...]
"""

from __future__ import annotations

import asyncio
import copy
import enum
import json
import socket
import struct
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import h11

from miles_core.session.messages import text_of

CHAT_PATH = "/v1/chat/completions"
ROUTING_KEY_HEADER = "x-smg-routing-key"


@dataclass(frozen=True)
class StubRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


class StubHTTPError(Exception):
    """Raised by a responder to answer with an HTTP error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Fault(enum.Enum):
    TIMEOUT = "timeout"  # read the request, never answer
    RESET = "reset"  # read the request, then reset the TCP connection
    STATUS_500 = "status_500"  # a 500 with a large body
    INVALID_JSON = "invalid_json"  # 200 with a cut-off JSON body
    MISSING_META_INFO = "missing_meta_info"  # a valid reply without choices[0].meta_info
    LOGPROB_COUNT_MISMATCH = "logprob_count_mismatch"  # completion_tokens disagrees with the pairs


Responder = Callable[[StubRequest], "dict[str, Any] | bytes"]


class TextCodec(Protocol):
    stop_id: int | None

    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ScriptedChat:
    """Deterministic replies that depend on the prompt and on the turn number per routing key.

    The last message's text ``t`` is answered with ``#<n> (<prompt tokens> prompt tokens): t``
    (first 24 chars), or -- when ``t`` starts with ``call `` -- with a tool call
    ``lookup({"query": rest})`` rendered the way the tiny ChatML template renders it. The
    completion ends with the stop token unless ``max_tokens`` cuts it (``finish_reason=length``).
    Log-probs are ``-((i % 7) + 1) / 8``: exact in binary, so their JSON is stable.
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self._turns: Counter[str] = Counter()

    def __call__(self, request: StubRequest) -> dict[str, Any]:
        body = json.loads(request.body)
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not input_ids:
            raise StubHTTPError(400, "input_ids must be a non-empty list")
        limit = body.get("max_tokens", body.get("max_completion_tokens"))
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise StubHTTPError(400, "max_tokens must be a non-negative integer")
        key = request.headers.get(ROUTING_KEY_HEADER, "")
        self._turns[key] += 1
        n = self._turns[key]
        last = text_of(body["messages"][-1].get("content"))
        message: dict[str, Any]
        if last.startswith("call "):
            arguments = {"query": last[5:]}
            text = f'<tool_call>\n{{"name": "lookup", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
            call = {"id": f"call_{n}", "type": "function", "function": {"name": "lookup", "arguments": json.dumps(arguments)}}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            text = f"#{n} ({len(input_ids)} prompt tokens): {last[:24]}"
            message = {"role": "assistant", "content": text}
        ids = [*self.codec.encode(text), *([self.codec.stop_id] if self.codec.stop_id is not None else [])]
        finish = "tool_calls" if "tool_calls" in message else "stop"
        if limit is not None and len(ids) > limit:
            ids, finish = ids[:limit], "length"
            message = {"role": "assistant", "content": self.codec.decode(ids)}
        return chat_reply(f"stub-{n}", message, ids, finish, prompt_tokens=len(input_ids))


class FixedReply:
    """Replays one reply's bytes for every request (benchmarks: no work in the stub)."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.body = json.dumps(reply, separators=(",", ":")).encode()

    def __call__(self, request: StubRequest) -> bytes:
        return self.body


def chat_reply(
    reply_id: str, message: dict[str, Any], token_ids: Sequence[int], finish_reason: str, *, prompt_tokens: int
) -> dict[str, Any]:
    """An SGLang-style chat reply for ``token_ids`` with the stub's log-probs."""
    pairs = [[-((i % 7) + 1) / 8, token_id] for i, token_id in enumerate(token_ids)]
    return {
        "id": reply_id,
        "object": "chat.completion",
        "created": 1700000000,
        "model": "stub",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "meta_info": {
                    "id": reply_id,
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(token_ids),
                    "output_token_logprobs": pairs,
                    "weight_version": "stub-0",
                    "routed_experts": "AAEC",
                },
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(token_ids),
            "total_tokens": prompt_tokens + len(token_ids),
        },
    }


class StubEngine:
    """Serve ``responder`` on ``host`` (a free port) from a background thread."""

    def __init__(
        self, responder: Responder, *, host: str = "127.0.0.1", delay_s: float | Callable[[StubRequest], float] = 0.0
    ) -> None:
        """``delay_s`` simulates generation time per chat request: seconds, or a function of
        the request."""
        self.responder = responder
        self.host = host
        self.delay_s = delay_s
        self.requests: list[StubRequest] = []
        self._faults: deque[Fault] = deque()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.url = ""

    # -- control (any thread) ----------------------------------------------------------------

    def inject(self, *faults: Fault) -> None:
        """The next ``len(faults)`` chat requests fail in these ways, in order."""
        with self._lock:
            self._faults.extend(faults)

    def pending_faults(self) -> list[Fault]:
        with self._lock:
            return list(self._faults)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def chat_requests(self, routing_key: str | None = None) -> list[StubRequest]:
        with self._lock:
            return [
                r
                for r in self.requests
                if r.path == CHAT_PATH and (routing_key is None or r.headers.get(ROUTING_KEY_HEADER) == routing_key)
            ]

    def start(self) -> str:
        ready = threading.Event()
        loop = self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._server = loop.run_until_complete(
                asyncio.start_server(self._connection, self.host, 0, backlog=2048)
            )
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="stub-engine", daemon=True)
        self._thread.start()
        ready.wait(10)
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> StubEngine:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- the server (stub thread) ------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await self._read_request(conn, reader)
                if request is None:
                    return
                with self._lock:
                    self.requests.append(request)
                    fault = self._faults.popleft() if request.path == CHAT_PATH and self._faults else None
                if fault is Fault.RESET:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if fault is Fault.TIMEOUT:
                    await asyncio.Event().wait()  # until the stub stops
                status, body = await self._answer(request, fault)
                headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
                writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
                writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                await writer.drain()
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError):
            return  # the client went away or spoke broken HTTP: nothing to answer
        except asyncio.CancelledError:
            return  # stop() ends open connections this way
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _read_request(self, conn: h11.Connection, reader: asyncio.StreamReader) -> StubRequest | None:
        head: h11.Request | None = None
        chunks: list[bytes] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                headers = {k.decode().lower(): v.decode() for k, v in head.headers}
                return StubRequest(head.method.decode(), head.target.decode(), headers, b"".join(chunks))
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _answer(self, request: StubRequest, fault: Fault | None) -> tuple[int, bytes]:
        if request.path == "/health":
            return 200, b""
        if request.path != CHAT_PATH or request.method != "POST":
            return 404, b'{"error": "not found"}'
        delay = self.delay_s(request) if callable(self.delay_s) else self.delay_s
        if delay:
            await asyncio.sleep(delay)
        if fault is Fault.STATUS_500:
            return 500, json.dumps({"error": "engine exploded: " + "x" * 10_000}).encode()
        try:
            reply = self.responder(request)
        except StubHTTPError as exc:
            return exc.status, json.dumps({"error": {"message": str(exc)}}).encode()
        if fault is Fault.INVALID_JSON:
            encoded = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
            return 200, encoded[: len(encoded) // 2]
        if fault in (Fault.MISSING_META_INFO, Fault.LOGPROB_COUNT_MISMATCH):
            data = copy.deepcopy(json.loads(reply) if isinstance(reply, bytes) else reply)
            meta = data["choices"][0]["meta_info"]
            if fault is Fault.MISSING_META_INFO:
                del data["choices"][0]["meta_info"]
            else:
                meta["completion_tokens"] = len(meta["output_token_logprobs"]) + 1
            reply = data
        return 200, reply if isinstance(reply, bytes) else json.dumps(reply, separators=(",", ":")).encode()
