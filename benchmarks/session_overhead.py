"""Per-turn overhead of the session server, and samples assembly time for a long trajectory.

Three processes on loopback: a stub engine replaying fixed reply bytes after a simulated
generation time, a session server in front of it, and this load generator. 64 agents each run a
20-turn conversation (starts staggered over one mean delay), first straight against the stub
(the baseline: what an agent pays without a session server), then through sessions. Turn ``t``
of agent ``i`` asks the stub for the same generation time in both runs (``--stub-delay-ms``
+-50%, seeded by ``(i, t)``, sent as a body field the session server forwards), so turns pair up.

Reported: per-turn latency p50/p99 of both runs; the added latency per turn (session minus
direct, paired by turn) at p50/p99; turns/s; the session server's CPU time per turn (from /proc:
the number machine load inflates least); and a check that every turn was recorded (records,
accumulated tokens and samples of every session). Then the samples of a 32k-token trajectory are
assembled in-process for v1 and v2 (median of 20), and encoded as the /samples reply.

Prints one JSON line; exits 1 if a turn was lost. Usage::

    python benchmarks/session_overhead.py [--sessions 64] [--turns 20] [--stub-delay-ms 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGETS = {"added_p50_ms": 2.0, "added_p99_ms": 10.0, "assembly_32k_ms": 50.0}
DELAY_FIELD = "stub_delay_s"  # an extra body field: forwarded upstream by the session server
COMPLETION_TEXT = "The answer is forty-two, as computed step by step."


def _tokenizer_dir() -> Path:
    from miles_core.assets.tiny_tokenizer import tiny_tokenizer_dir

    return tiny_tokenizer_dir(Path(os.environ.get("MILES_CACHE_DIR", tempfile.gettempdir())) / "miles-bench")


def _fixed_reply() -> dict:
    from miles_core.session.tokenizer import ChatTokenizer
    from miles_core.testing.engine_stub import chat_reply

    tok = ChatTokenizer.from_dir(_tokenizer_dir())
    ids = [*tok.encode(COMPLETION_TEXT), tok.stop_id]
    return chat_reply("bench", {"role": "assistant", "content": COMPLETION_TEXT}, ids, "stop", prompt_tokens=0)


def _requested_delay(request) -> float:
    return json.loads(request.body).get(DELAY_FIELD, 0.0)


def _turn_delay(agent: int, turn: int, mean_s: float) -> float:
    return mean_s * random.Random(agent * 100_003 + turn).uniform(0.5, 1.5)


def _run_stub(queue) -> None:
    from miles_core.testing.engine_stub import FixedReply, StubEngine

    with StubEngine(FixedReply(_fixed_reply()), delay_s=_requested_delay) as stub:
        queue.put((stub.url, os.getpid()))
        queue.get()  # wait for "stop"


def _run_session_server(queue, upstream: str, version: str) -> None:
    from miles_core.session.config import SessionServerConfig
    from miles_core.session.embed import base_url, bind_socket, serve_forever
    from miles_core.session.server import build_app

    app = build_app(SessionServerConfig(upstream_url=upstream, tokenizer_dir=_tokenizer_dir(), version=version))
    sock = bind_socket("127.0.0.1", 0)
    queue.put((base_url(sock), os.getpid()))
    serve_forever(app, sock)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _agents(
    url: str, sessions: int, turns: int, *, through_session: bool, mean_delay_s: float
) -> tuple[dict[tuple[int, int], float], float, list[str]]:
    """Run the agents; per-turn latencies keyed by (agent, turn), wall seconds, session ids."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        ids = []
        if through_session:
            ids = [(await client.post("/sessions")).json()["session_id"] for _ in range(sessions)]
    latencies: dict[tuple[int, int], float] = {}
    tls = httpx.create_ssl_context()  # unused on loopback http, but each client would build one

    async def agent(i: int) -> None:
        # One client per agent, as separate agents have: a single pool serving 64 concurrent
        # requests would spend more CPU scanning its connections than the server under test.
        async with httpx.AsyncClient(base_url=url, timeout=120, verify=tls) as client:
            await asyncio.sleep(mean_delay_s * i / sessions)
            path = f"/sessions/{ids[i]}/v1/chat/completions" if through_session else "/v1/chat/completions"
            history = [{"role": "system", "content": f"You are agent {i}."}]
            for turn in range(turns):
                history.append({"role": "user", "content": f"Question {turn} from agent {i}: what is {turn} * {i}?"})
                delay = _turn_delay(i, turn, mean_delay_s)
                body = json.dumps({"messages": history, "max_tokens": 64, DELAY_FIELD: delay}).encode()
                started = time.perf_counter()
                response = await client.post(path, content=body, headers={"content-type": "application/json"})
                latencies[i, turn] = time.perf_counter() - started
                response.raise_for_status()
                history.append(response.json()["choices"][0]["message"])

    started = time.perf_counter()
    await asyncio.gather(*(agent(i) for i in range(sessions)))
    return latencies, time.perf_counter() - started, ids


async def _lost_records(url: str, ids: list[str], turns: int, completion_tokens: int) -> int:
    """Turns missing from records, accumulated tokens or samples, over all sessions."""
    import httpx

    lost = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for sid in ids:
            state = (await client.get(f"/sessions/{sid}")).json()
            [sample] = (await client.post(f"/sessions/{sid}/samples")).json()["samples"]
            recorded = len(state["records"])
            trained_turns = sum(sample["loss_mask"]) // completion_tokens
            complete = sample["tokens"] == state["metadata"]["accumulated_token_ids"]
            lost += max(turns - recorded, turns - trained_turns, 0 if complete else turns)
    return lost


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


def _assembly(version_name: str, total_tokens: int = 32_768, repeats: int = 20) -> tuple[float, float]:
    """Median ms to assemble the samples of one ``total_tokens`` trajectory, and to encode them."""
    from miles_core.session.completion import Completion
    from miles_core.session.normalize import normalize_chat_request
    from miles_core.session.tokenizer import ChatTokenizer
    from miles_core.session.trajectory import SampleOptions, TurnRecord
    from miles_core.session.versions import LinearVersion, TreeVersion
    from miles_core.strict_json import dumps

    tok = ChatTokenizer.from_dir(_tokenizer_dir())
    version = {"v1": LinearVersion(), "v2": TreeVersion()}[version_name]
    store = version.create_store(max_turns=1024)
    history: list[dict] = []
    turn = 0
    while not history or len(store.describe()["metadata"]["accumulated_token_ids"]) < total_tokens:
        history.append({"role": "user", "content": f"step {turn}: " + "observation " * 80})
        chat = normalize_chat_request(json.dumps({"messages": history}).encode())
        plan = store.plan(chat, tok)
        text = f"thought {turn}: " + "reasoning " * 100
        ids = (*tok.encode(text), tok.stop_id)
        completion = Completion({"role": "assistant", "content": text}, ids, tuple(-0.5 for _ in ids), "stop", "w0")
        store.commit(plan, completion, TurnRecord(dumps({"input_ids": list(plan.prompt_ids)}), b"{}", 0.0, 0.0))
        history.append(completion.message)
        turn += 1
    assemble, encode = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        batch = store.samples(SampleOptions())
        assemble.append(time.perf_counter() - started)
        started = time.perf_counter()
        dumps(batch.to_dict())
        encode.append(time.perf_counter() - started)
    assert len(batch.samples[0].tokens) >= total_tokens
    return statistics.median(assemble) * 1000, statistics.median(encode) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--stub-delay-ms", type=float, default=500.0, help="mean simulated generation time per turn")
    parser.add_argument("--version", default="v1", help="session version under load")
    args = parser.parse_args()

    ctx = multiprocessing.get_context("spawn")
    _tokenizer_dir()  # generate once, before the children race for it
    stub_queue, server_queue = ctx.Queue(), ctx.Queue()
    stub = ctx.Process(target=_run_stub, args=(stub_queue,), daemon=True)
    stub.start()
    stub_url, _ = stub_queue.get(timeout=120)
    server = ctx.Process(target=_run_session_server, args=(server_queue, stub_url, args.version), daemon=True)
    server.start()
    server_url, server_pid = server_queue.get(timeout=120)
    mean_delay = args.stub_delay_ms / 1000
    try:
        asyncio.run(_agents(server_url, 4, 2, through_session=True, mean_delay_s=0))  # warm-up
        client_before = _cpu_seconds(os.getpid())
        direct, direct_s, _ = asyncio.run(
            _agents(stub_url, args.sessions, args.turns, through_session=False, mean_delay_s=mean_delay)
        )
        client_direct = _cpu_seconds(os.getpid()) - client_before
        cpu_before, client_before = _cpu_seconds(server_pid), _cpu_seconds(os.getpid())
        via, via_s, ids = asyncio.run(
            _agents(server_url, args.sessions, args.turns, through_session=True, mean_delay_s=mean_delay)
        )
        server_cpu = _cpu_seconds(server_pid) - cpu_before
        client_via = _cpu_seconds(os.getpid()) - client_before
        completion_tokens = len(_fixed_reply()["choices"][0]["meta_info"]["output_token_logprobs"])
        lost = asyncio.run(_lost_records(server_url, ids, args.turns, completion_tokens))
    finally:
        server.terminate()
        stub_queue.put("stop")
        server.join(10)
        stub.join(10)
    assembly_v1, encode_v1 = _assembly("v1")
    assembly_v2, _ = _assembly("v2")
    added = [via[key] - direct[key] for key in via]
    p = {
        f"{label}_p{int(q * 100)}_ms": _percentile(values, q) * 1000
        for label, values in (("direct", list(direct.values())), ("session", list(via.values())), ("added", added))
        for q in (0.5, 0.99)
    }
    result = {
        "benchmark": "session_overhead",
        "sessions": args.sessions,
        "turns": args.turns,
        "version": args.version,
        "stub_delay_ms": args.stub_delay_ms,
        **{k: round(v, 3) for k, v in p.items()},
        "ratio_p50": round(p["session_p50_ms"] / p["direct_p50_ms"], 4),
        "turns_per_s": round(len(via) / via_s, 1),
        "server_cpu_ms_per_turn": round(server_cpu / len(via) * 1000, 3),
        # the load generator shares the machine's cores: its CPU per turn, direct and through sessions
        "client_cpu_ms_per_turn": [round(client_direct / len(direct) * 1000, 3), round(client_via / len(via) * 1000, 3)],
        "direct_turns_per_s": round(len(direct) / direct_s, 1),
        "lost_records": lost,
        "assembly_32k_ms": round(assembly_v1, 3),
        "assembly_32k_v2_ms": round(assembly_v2, 3),
        "samples_json_32k_ms": round(encode_v1, 3),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    result["meets_targets"] = lost == 0 and all(result[k] <= v for k, v in TARGETS.items())
    print(json.dumps(result))
    sys.exit(0 if lost == 0 else 1)


if __name__ == "__main__":
    main()
