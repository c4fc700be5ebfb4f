"""``miles session serve --workers N``: sessions spread over worker processes, each request served
by its session's owner whichever connection and worker it arrives on, with the same records and
samples as one process; what cannot be moved is refused (421) without touching the session; the
server stops with its workers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.session.workers import Router, Shard, owner_of
from miles_core.testing.engine_stub import ScriptedChat, StubEngine
from miles_core.testing.servers import wait_until_healthy

register_cpu_ci(est_time=25, suite="stage-a-cpu")

WORKERS = 3


def _router(index: int, count: int) -> Router:
    return Router(Shard(index, count), outgoing={}, incoming=[])


def test_a_worker_creates_only_ids_it_owns_and_limits_split_between_workers() -> None:
    from miles_core.session.config import ServiceLimits

    shard = Shard(1, 3)
    ids = shard.new_ids(200)
    assert len(set(ids)) == 200 and all(owner_of(i, 3) == 1 and len(i) == 32 for i in ids)
    assert shard.limits(ServiceLimits(max_sessions=10, max_turns=7)) == ServiceLimits(max_sessions=4, max_turns=7)


def test_requests_route_to_their_sessions_owner_and_creations_round_robin() -> None:
    sid = Shard(2, 3).new_ids(1)[0]
    router = _router(0, 3)
    assert router.target(f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1".encode()) == 2
    assert router.target(f"GET /sessions/{sid}?x=1 HTTP/1.1".encode()) == 2
    escaped = "".join(f"%{ord(c):02x}" for c in sid)  # what a client may send for the same path
    assert router.target(f"DELETE /sessions/{escaped} HTTP/1.1".encode()) == 2
    assert [router.target(b"POST /sessions HTTP/1.1") for _ in range(6)] == [1, 2, 0, 1, 2, 0]
    for line in (b"GET /health HTTP/1.1", b"GET /sessions/ HTTP/1.1", b"garbage", b""):
        assert router.target(line) is None


def _serve(tokenizer_dir: Path, upstream: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, "-m", "miles_core", "session", "serve", "--upstream", upstream,
            "--tokenizer", str(tokenizer_dir), "--port", "0", "--log-level", "warning", *extra]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    line = process.stdout.readline() if process.stdout else ""
    assert "listening on http://127.0.0.1:" in line, (line, process.stderr.read() if process.poll() else "")
    url = line.split("listening on ")[1].split(",")[0]
    # every worker answers once it has built its app; until then connections queue
    wait_until_healthy(url, process, timeout=60, describe=lambda: process.stderr.read() if process.stderr else "")
    return process, url


@pytest.fixture(scope="module")
def stub(chat_tokenizer) -> Iterator[StubEngine]:
    with StubEngine(ScriptedChat(chat_tokenizer)) as engine:
        yield engine


@pytest.fixture(scope="module")
def workers_server(tokenizer_dir, stub) -> Iterator[tuple[subprocess.Popen[str], str]]:
    process, url = _serve(tokenizer_dir, stub.url, "--workers", str(WORKERS), "--max-sessions", "300")
    yield process, url
    if process.poll() is None:
        process.terminate()
        assert process.wait(timeout=30) == 0
    assert "Traceback" not in (process.stderr.read() if process.stderr else "")


def _turns(client: httpx.Client, conversations: dict[str, list[dict]], turns: int) -> list[int]:
    """``turns`` rounds of one chat turn per session, interleaved; the HTTP statuses."""
    statuses = []
    for turn in range(turns):
        for sid, messages in conversations.items():
            messages.append({"role": "user", "content": f"turn {turn} of {sid[:6]}"})
            reply = client.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages})
            statuses.append(reply.status_code)
            messages.append(reply.json()["choices"][0]["message"])
    return statuses


def _samples(client: httpx.Client, sid: str) -> list[dict]:
    reply = client.post(f"/sessions/{sid}/samples", content=b"{}")
    assert reply.status_code == 200, reply.text
    return reply.json()["samples"]


def test_every_request_reaches_its_owner_with_the_samples_one_process_gives(workers_server, serve) -> None:
    _, url = workers_server
    single = serve("v1")
    with httpx.Client(base_url=url, timeout=30) as shared:
        ids = [shared.post("/sessions").json()["session_id"] for _ in range(2 * WORKERS)]
        assert {owner_of(sid, WORKERS) for sid in ids} == set(range(WORKERS))  # spread over all
        # one connection for all sessions, turns interleaved: most requests move it to another worker
        conversations: dict[str, list[dict]] = {sid: [{"role": "system", "content": "be terse"}] for sid in ids}
        assert _turns(shared, conversations, 3) == [200] * 3 * len(ids)
        got = [_samples(shared, sid) for sid in ids]
    # the same conversations against one process: identical tokens, masks and log-probs
    with httpx.Client(base_url=single.url, timeout=30) as client:
        # the same texts, which name the worker server's session ids
        references = {single.create(): [{"role": "system", "content": "be terse"}] for _ in ids}
        statuses = []
        for turn in range(3):
            for sid, reference in zip(ids, list(references)):
                messages = references[reference]
                messages.append({"role": "user", "content": f"turn {turn} of {sid[:6]}"})
                reply = client.post(f"/sessions/{reference}/v1/chat/completions", json={"messages": messages})
                statuses.append(reply.status_code)
                messages.append(reply.json()["choices"][0]["message"])
        assert statuses == [200] * 3 * len(ids)
        expected = [_samples(client, reference) for reference in references]
    assert got == expected
    assert all(len(samples[0]["tokens"]) > 30 for samples in got)


def test_agents_on_their_own_connections_and_deletes_reach_owners(workers_server) -> None:
    _, url = workers_server
    with httpx.Client(base_url=url, timeout=30) as setup:
        ids = [setup.post("/sessions").json()["session_id"] for _ in range(6)]
    for sid in ids:
        with httpx.Client(base_url=url, timeout=30) as own:
            assert _turns(own, {sid: []}, 3) == [200, 200, 200]
            assert len(own.get(f"/sessions/{sid}").json()["records"]) == 3
            assert own.delete(f"/sessions/{sid}").status_code == 204
            assert own.get(f"/sessions/{sid}").status_code == 404


def _raw_exchange(url: str, payload: bytes, replies: int) -> list[tuple[int, bytes]]:
    """Send ``payload`` (pipelined requests) on one connection; read ``replies`` replies."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(payload)
        buffer, out = b"", []
        while len(out) < replies:
            while b"\r\n\r\n" not in buffer:
                chunk = sock.recv(65536)
                assert chunk, f"connection closed after {len(out)} replies: {buffer!r}"
                buffer += chunk
            head, buffer = buffer.split(b"\r\n\r\n", 1)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            while len(buffer) < length:
                buffer += sock.recv(65536)
            out.append((int(head.split(b" ")[1]), buffer[:length]))
            buffer = buffer[length:]
        return out


def _chat_request(sid: str, text: str) -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    return (f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def test_a_pipelined_request_for_another_workers_session_is_misdirected_and_changes_nothing(workers_server) -> None:
    _, url = workers_server
    with httpx.Client(base_url=url, timeout=30) as client:
        ids = [client.post("/sessions").json()["session_id"] for _ in range(2 * WORKERS)]
        first = ids[0]
        other = next(sid for sid in ids if owner_of(sid, WORKERS) != owner_of(first, WORKERS))
        before = client.get(f"/sessions/{other}").content
        replies = _raw_exchange(url, _chat_request(first, "hello") + _chat_request(other, "hello"), 2)
        assert replies[0][0] == 200
        assert replies[1][0] == 421, replies[1]
        assert json.loads(replies[1][1])["error"]["type"] == "misdirected_request_error"
        assert client.get(f"/sessions/{other}").content == before
        assert len(client.get(f"/sessions/{first}").json()["records"]) == 1


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_a_worker_that_dies_stops_the_server_with_its_status(tokenizer_dir, stub) -> None:
    process, _ = _serve(tokenizer_dir, stub.url, "--workers", "2")
    try:
        workers = [pid for pid in _children(process.pid)
                   if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        assert process.wait(timeout=30) == 128 + signal.SIGKILL
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                  for pid in workers):
            assert time.monotonic() < deadline, "a worker outlived the server"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()
