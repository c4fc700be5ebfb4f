"""Per-turn overhead and throughput of the session server, and samples assembly time.

On loopback: a stub engine replaying fixed reply bytes after a simulated generation time, a
session server in front of it (``--workers`` processes, as ``miles session serve --workers``;
default: the machine's cores, at most 4), and this load generator. N agents
(``--sessions``) each run a ``--turns``-turn conversation (starts staggered over one mean delay),
straight against the stub (the baseline: what agents get without a session server) and through
sessions, in ``--rounds`` interleaved rounds (direct then sessions, then the other way round, so a
change of machine load hits both alike). Turn ``t`` of agent ``i`` asks the stub for the same
generation time in both (``--stub-delay-ms`` +-50%, seeded by ``(i, t)``, sent as a body field the
session server forwards), so turns pair up.

The load generator and the stub are lean on purpose -- an HTTP/1.1 client per agent on
:class:`miles_core.engine.http.HTTPPool`, a stub parsing requests with httptools: real agents run
elsewhere, and on a 2-core machine an httpx client per agent (1.6 ms of CPU per turn) and an h11
stub (0.6 ms) took the CPU the session server needed. With them, 256 agents measured only how
the three processes shared two cores (via/direct 0.59 was exactly their CPU per turn direct over
through sessions); now the direct run approaches what the agents ask for and the session run is
limited by the server's own CPU.

Reported: per-turn latency p50/p99 of both runs; the added latency per turn (session minus
direct, paired by turn) at p50/p99; turns/s of both and their ratio per round
(``throughput_ratio``: the median); each process's CPU ms per turn and the machine's idle share
per run (from /proc); the load average; and a check that every turn was recorded (records,
accumulated tokens and samples of every session). Then the samples of a 32k-token trajectory are
assembled in-process for v1 and v2 (median of 20), and encoded as the /samples reply.

Prints one JSON line; exits 1 if a turn was lost. Usage::

    python benchmarks/session_overhead.py [--sessions 64] [--turns 20] [--stub-delay-ms 500] [--rounds 2] [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from miles_core.engine.http import HTTPPool
    from miles_core.session.tokenizer import ChatTokenizer

TARGETS = {"added_p50_ms": 2.0, "added_p99_ms": 10.0, "assembly_32k_ms": 50.0, "throughput_ratio": 0.9}
DELAY_FIELD = "stub_delay_s"  # an extra body field: forwarded upstream by the session server
DELAY_RE = re.compile(rb'"stub_delay_s":\s*([0-9.eE+-]+)')
COMPLETION_TEXT = "The answer is forty-two, as computed step by step."


def _tokenizer_dir() -> Path:
    from miles_core.assets.tiny_tokenizer import tiny_tokenizer_dir

    return tiny_tokenizer_dir(Path(os.environ.get("MILES_CACHE_DIR", tempfile.gettempdir())) / "miles-bench")


def _tokenizer() -> tuple[ChatTokenizer, int]:
    """The benchmark's tokenizer and the stop token that ends a reply."""
    from miles_core.session.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_dir(_tokenizer_dir())
    if tok.stop_id is None:
        raise ValueError(f"the tokenizer in {_tokenizer_dir()} has no stop token to end a reply with")
    return tok, tok.stop_id


def _fixed_reply() -> dict:
    from miles_core.testing.engine_stub import chat_reply

    tok, stop_id = _tokenizer()
    ids = [*tok.encode(COMPLETION_TEXT), stop_id]
    return chat_reply("bench", {"role": "assistant", "content": COMPLETION_TEXT}, ids, "stop", prompt_tokens=0)


def _turn_delay(agent: int, turn: int, mean_s: float) -> float:
    return mean_s * random.Random(agent * 100_003 + turn).uniform(0.5, 1.5)


class _StubProtocol(asyncio.Protocol):
    """One connection of the stub engine: every request is answered with the fixed reply after
    the generation time its body asks for (``stub_delay_s``); replies keep request order."""

    def __init__(self, reply: bytes) -> None:
        import httptools

        self._reply = reply
        self._parser = httptools.HttpRequestParser(self)
        self._body: list[bytes] = []
        self._pending: asyncio.Future | None = None  # the previous reply on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport: uvloop's have asyncio.Transport's methods but do not subclass it
        self._transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except Exception:  # not HTTP: drop the connection, as a server would
            self._transport.close()

    def on_message_begin(self) -> None:
        self._body = []

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        match = DELAY_RE.search(b"".join(self._body))
        delay = float(match.group(1)) if match else 0.0
        loop = asyncio.get_running_loop()
        previous, done = self._pending, loop.create_future()
        self._pending = done

        def answer() -> None:
            if previous is not None and not previous.done():
                previous.add_done_callback(lambda _: answer())
                return
            if not self._transport.is_closing():
                self._transport.write(self._reply)
            done.set_result(None)

        loop.call_later(delay, answer)


def _run_stub(queue: Queue[tuple[str, int]]) -> None:
    import socket

    import uvloop

    body = json.dumps(_fixed_reply(), separators=(",", ":")).encode()
    reply = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(4096)
        # create_server listens again, with its own backlog (uvloop's default: 100); the session
        # server's pool opens a connection per agent at once, and a full queue drops SYNs (1 s retry)
        server = await loop.create_server(lambda: _StubProtocol(reply), sock=sock, backlog=4096)
        queue.put((f"http://127.0.0.1:{sock.getsockname()[1]}", os.getpid()))
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


def _run_session_server(queue: Queue[tuple[str, list[int]]], upstream: str, version: str, workers: int) -> None:
    """``miles session serve --workers N`` as a function: the pids reported are the workers'."""
    from miles_core.session.config import SessionServerConfig
    from miles_core.session.embed import base_url, bind_socket, serve_forever
    from miles_core.session.server import build_app
    from miles_core.session.workers import serve_workers

    config = SessionServerConfig(upstream_url=upstream, tokenizer_dir=_tokenizer_dir(), version=version)
    sock = bind_socket("127.0.0.1", 0)
    if workers == 1:
        app = build_app(config)
        queue.put((base_url(sock), [os.getpid()]))
        serve_forever(app, sock)
    else:
        sys.exit(serve_workers(config, sock, workers, on_started=lambda pids: queue.put((base_url(sock), pids))))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of all CPUs since boot (Linux /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return values[3] + values[4], sum(values)


def _client(url: str) -> HTTPPool:
    from miles_core.engine.http import HTTPPool

    headers = {"user-agent": "session-overhead-bench", "content-type": "application/json"}
    return HTTPPool(url, headers=headers, timeout=120, connect_timeout=30, max_connections=1, keepalive_s=3600)


async def _agents(
    url: str, sessions: int, turns: int, *, through_session: bool, mean_delay_s: float
) -> tuple[dict[tuple[int, int], float], float, list[str]]:
    """Run the agents; per-turn latencies keyed by (agent, turn), wall seconds, session ids."""
    setup = _client(url)
    ids = []
    if through_session:
        for _ in range(sessions):
            status, body = await setup.exchange("POST", "/sessions", {}, b"")
            assert status == 200, body
            ids.append(json.loads(body)["session_id"])
    await setup.aclose()
    latencies: dict[tuple[int, int], float] = {}

    async def agent(i: int) -> None:
        client = _client(url)  # one connection per agent, as separate agents have
        await asyncio.sleep(mean_delay_s * i / sessions)
        path = f"/sessions/{ids[i]}/v1/chat/completions" if through_session else "/v1/chat/completions"
        history = [{"role": "system", "content": f"You are agent {i}."}]
        for turn in range(turns):
            history.append({"role": "user", "content": f"Question {turn} from agent {i}: what is {turn} * {i}?"})
            delay = _turn_delay(i, turn, mean_delay_s)
            body = json.dumps({"messages": history, "max_tokens": 64, DELAY_FIELD: delay}).encode()
            started = time.perf_counter()
            status, reply = await client.exchange("POST", path, {}, body)
            latencies[i, turn] = time.perf_counter() - started
            if status != 200:
                raise RuntimeError(f"agent {i} turn {turn}: HTTP {status}: {reply[:300]!r}")
            history.append(json.loads(reply)["choices"][0]["message"])
        await client.aclose()

    started = time.perf_counter()
    await asyncio.gather(*(agent(i) for i in range(sessions)))
    return latencies, time.perf_counter() - started, ids


def _phase(url: str, args: argparse.Namespace, *, through_session: bool, pids: dict[str, int]) -> dict:
    """One run of the agents, with the CPU every process spent and the machine's idle share."""
    import uvloop

    cpu_before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    idle_before, total_before = _machine_ticks()
    latencies, wall, ids = uvloop.run(
        _agents(url, args.sessions, args.turns, through_session=through_session, mean_delay_s=args.stub_delay_ms / 1000)
    )
    idle_after, total_after = _machine_ticks()
    turns = len(latencies)
    cpu = {name: (_cpu_seconds(pid) - cpu_before[name]) / turns * 1000 for name, pid in pids.items()}
    return {
        "latencies": latencies,
        "ids": ids,
        "turns_per_s": turns / wall,
        "cpu_ms_per_turn": cpu,
        "machine_idle": (idle_after - idle_before) / max(total_after - total_before, 1),
    }


async def _lost_records(url: str, ids: list[str], turns: int, completion_tokens: int) -> int:
    """Turns missing from records, accumulated tokens or samples, over all sessions."""
    client = _client(url)
    lost = 0
    for sid in ids:
        _, described = await client.exchange("GET", f"/sessions/{sid}", {}, None)
        _, sampled = await client.exchange("POST", f"/sessions/{sid}/samples", {}, b"")
        state = json.loads(described)
        [sample] = json.loads(sampled)["samples"]
        recorded = len(state["records"])
        trained_turns = sum(sample["loss_mask"]) // completion_tokens
        complete = sample["tokens"] == state["metadata"]["accumulated_token_ids"]
        lost += max(turns - recorded, turns - trained_turns, 0 if complete else turns)
    await client.aclose()
    return lost


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


def _assembly(version_name: str, total_tokens: int = 32_768, repeats: int = 20) -> tuple[float, float]:
    """Median ms to assemble the samples of one ``total_tokens`` trajectory, and to encode them."""
    from miles_core.session.completion import Completion
    from miles_core.session.normalize import normalize_chat_request
    from miles_core.session.trajectory import SampleOptions, TurnRecord
    from miles_core.session.versions import LinearVersion, TreeVersion
    from miles_core.strict_json import dumps

    tok, stop_id = _tokenizer()
    versions: dict[str, LinearVersion | TreeVersion] = {"v1": LinearVersion(), "v2": TreeVersion()}
    version = versions[version_name]
    store = version.create_store(max_turns=1024)
    history: list[dict] = []
    turn = 0
    while not history or len(store.describe()["metadata"]["accumulated_token_ids"]) < total_tokens:
        history.append({"role": "user", "content": f"step {turn}: " + "observation " * 80})
        chat = normalize_chat_request(json.dumps({"messages": history}).encode())
        plan = store.plan(chat, tok)
        text = f"thought {turn}: " + "reasoning " * 100
        ids = (*tok.encode(text), stop_id)
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
    parser.add_argument("--sessions", type=int, default=64, help="concurrent agents, one session each")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--stub-delay-ms", type=float, default=500.0, help="mean simulated generation time per turn")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved direct/session run pairs")
    parser.add_argument("--version", default="v1", help="session version under load")
    parser.add_argument("--workers", type=int, default=None,
                        help="session server processes (miles session serve --workers; default: the machine's "
                        "cores, at most 4)")
    parser.add_argument("--skip-assembly", action="store_true", help="leave out the 32k-token assembly timing")
    args = parser.parse_args()
    if args.workers is None:
        args.workers = min(os.cpu_count() or 1, 4)
    for name in ("sessions", "turns", "rounds", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    load_before = os.getloadavg()
    ctx = multiprocessing.get_context("spawn")
    _tokenizer_dir()  # generate once, before the children race for it
    stub_queue, server_queue = ctx.Queue(), ctx.Queue()
    stub = ctx.Process(target=_run_stub, args=(stub_queue,), daemon=True)
    stub.start()
    stub_url, stub_pid = stub_queue.get(timeout=120)
    server = ctx.Process(target=_run_session_server, args=(server_queue, stub_url, args.version, args.workers))
    server.start()
    server_url, server_pids = server_queue.get(timeout=120)
    servers = {"session_server": server_pids[0]} if args.workers == 1 else {
        f"session_worker{i}": pid for i, pid in enumerate(server_pids)
    }
    pids = {"load_generator": os.getpid(), "stub": stub_pid, **servers}
    print(f"processes: {json.dumps(pids)}", file=sys.stderr, flush=True)  # e.g. for a profiler
    rounds: list[tuple[dict, dict]] = []
    lost = 0
    try:
        import uvloop

        uvloop.run(_agents(server_url, 4, 2, through_session=True, mean_delay_s=0))  # warm-up
        completion_tokens = len(_fixed_reply()["choices"][0]["meta_info"]["output_token_logprobs"])
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            runs = {via: _phase(server_url if via else stub_url, args, through_session=via, pids=pids) for via in order}
            rounds.append((runs[False], runs[True]))
            lost += uvloop.run(_lost_records(server_url, runs[True]["ids"], args.turns, completion_tokens))
    finally:
        server.terminate()
        stub.terminate()
        server.join(10)
        stub.join(10)
    load_after = os.getloadavg()

    direct = [v for d, _ in rounds for v in d["latencies"].values()]
    via = [v for _, s in rounds for v in s["latencies"].values()]
    added = [s["latencies"][key] - d["latencies"][key] for d, s in rounds for key in s["latencies"]]
    p = {
        f"{label}_p{int(q * 100)}_ms": _percentile(values, q) * 1000
        for label, values in (("direct", direct), ("session", via), ("added", added))
        for q in (0.5, 0.99)
    }
    ratios = [s["turns_per_s"] / d["turns_per_s"] for d, s in rounds]

    # CPU ms per turn, the median over rounds: per process, and per role (the session server's is
    # all its workers' together)
    per_process = {
        run: {name: round(statistics.median(r[index]["cpu_ms_per_turn"][name] for r in rounds), 3) for name in pids}
        for index, run in enumerate(("direct", "session"))
    }
    per_role = {
        run: {**{k: v for k, v in cpu.items() if k not in servers}, "session_server": round(sum(cpu[k] for k in servers), 3)}
        for run, cpu in per_process.items()
    }

    result = {
        "benchmark": "session_overhead",
        "sessions": args.sessions,
        "turns": args.turns,
        "rounds": args.rounds,
        "version": args.version,
        "stub_delay_ms": args.stub_delay_ms,
        **{k: round(v, 3) for k, v in p.items()},
        "ratio_p50": round(p["session_p50_ms"] / p["direct_p50_ms"], 4),
        "throughput_ratio": round(statistics.median(ratios), 4),
        "throughput_ratios": [round(x, 4) for x in ratios],
        "turns_per_s": round(statistics.median(s["turns_per_s"] for _, s in rounds), 1),
        "direct_turns_per_s": round(statistics.median(d["turns_per_s"] for d, _ in rounds), 1),
        "offered_turns_per_s": round(args.sessions / (args.stub_delay_ms / 1000), 1),
        "workers": args.workers,
        "server_cpu_ms_per_turn": per_role["session"]["session_server"],
        "cpu_ms_per_turn": per_role,
        "worker_cpu_ms_per_turn": {name: per_process["session"][name] for name in servers if args.workers > 1},
        "machine_idle": {
            "direct": round(statistics.median(d["machine_idle"] for d, _ in rounds), 3),
            "session": round(statistics.median(s["machine_idle"] for _, s in rounds), 3),
        },
        "lost_records": lost,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": [round(load_before[0], 2), round(load_after[0], 2)],
    }
    if not args.skip_assembly:
        assembly_v1, encode_v1 = _assembly("v1")
        assembly_v2, _ = _assembly("v2")
        result.update(
            assembly_32k_ms=round(assembly_v1, 3), assembly_32k_v2_ms=round(assembly_v2, 3),
            samples_json_32k_ms=round(encode_v1, 3),
        )
    ceilings_met = all(result.get(k, 0) <= v for k, v in TARGETS.items() if k != "throughput_ratio")
    result["meets_targets"] = lost == 0 and ceilings_met and result["throughput_ratio"] >= TARGETS["throughput_ratio"]
    print(json.dumps(result))
    sys.exit(0 if lost == 0 else 1)


if __name__ == "__main__":
    main()
