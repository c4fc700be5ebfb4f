"""``miles session serve`` stops on SIGINT or SIGTERM like a command that finished: requests in
flight are answered, the port is released and the status is 0 -- with one worker as with several
(no click "Aborted!", no death by the signal). A second SIGINT during that shutdown stops at once
with 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.testing.engine_stub import ScriptedChat, StubEngine
from miles_core.testing.servers import assert_port_free, wait_until_healthy

register_cpu_ci(est_time=35, suite="stage-a-cpu")

SIGNALS = [pytest.param(signal.SIGINT, id="SIGINT"), pytest.param(signal.SIGTERM, id="SIGTERM")]


class Served:
    """``miles session serve`` in a subprocess on a free port, its stderr collected as it comes."""

    def __init__(self, tokenizer_dir: Path, upstream: str, workers: int) -> None:
        argv = [sys.executable, "-m", "miles_core", "session", "serve", "--upstream", upstream,
                "--tokenizer", str(tokenizer_dir), "--port", "0", "--workers", str(workers), "--log-level", "info"]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ,
            start_new_session=True,  # a process group of its own, as a terminal gives a command
        )
        self._stderr: list[str] = []
        assert self.process.stderr is not None and self.process.stdout is not None
        self._reader = threading.Thread(target=self._collect, args=(self.process.stderr,), daemon=True)
        self._reader.start()
        line = self.process.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (line, self.stderr())
        self.url = line.split("listening on ")[1].split(",")[0]
        self.port = int(self.url.rsplit(":", 1)[1])

    def _collect(self, stream: Iterator[str]) -> None:
        for line in stream:
            self._stderr.append(line)

    def signal(self, sig: int, *, group: bool = False) -> None:
        """Send ``sig`` to the server process, or to its whole group (workers included) as a
        terminal's Ctrl-C does."""
        if group:
            os.killpg(self.process.pid, sig)
        else:
            self.process.send_signal(sig)

    def stderr(self) -> str:
        if self.process.poll() is not None:
            self._reader.join(10)
        return "".join(self._stderr)

    def wait_until(self, text: str, count: int = 1, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.stderr().count(text) < count:
            assert time.monotonic() < deadline and self.process.poll() is None, (text, self.stderr())
            time.sleep(0.02)

    def wait_until_healthy(self, timeout: float = 60) -> None:
        wait_until_healthy(self.url, self.process, timeout, describe=self.stderr)

    def exit_status(self, timeout: float = 30) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise

    def close(self) -> None:
        """Kill whatever is left of the server's process group (its workers included)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)


@pytest.fixture
def serve(tokenizer_dir) -> Iterator:
    started: list[Served] = []

    def start(upstream: str, workers: int) -> Served:
        started.append(Served(tokenizer_dir, upstream, workers))
        return started[-1]

    yield start
    for served in started:
        served.close()


@pytest.fixture(scope="module")
def slow_stub(chat_tokenizer) -> Iterator[StubEngine]:
    """An engine whose every chat takes a second (a turn in flight when a signal comes)."""
    with StubEngine(ScriptedChat(chat_tokenizer), delay_s=1.0) as stub:
        yield stub


def assert_clean(served: Served) -> None:
    err = served.stderr()
    assert "Aborted!" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_signal_stops_the_server_with_status_0_and_frees_the_port(serve, workers, sig) -> None:
    # the routes used here never reach the engine: any URL will do
    served = serve("http://127.0.0.1:9", workers)
    served.wait_until_healthy()
    served.signal(sig)
    assert served.exit_status() == 0, served.stderr()
    assert_clean(served)
    assert "Shutting down" in served.stderr()
    assert_port_free(served.port)


@pytest.mark.parametrize(
    ("workers", "sig", "group"),
    [
        pytest.param(1, signal.SIGINT, False, id="1-SIGINT"),
        pytest.param(2, signal.SIGTERM, False, id="2-SIGTERM"),
        pytest.param(2, signal.SIGINT, True, id="2-Ctrl-C-to-the-process-group"),
    ],
)
def test_a_turn_in_flight_is_answered_before_the_server_exits(serve, slow_stub, workers, sig, group) -> None:
    served = serve(slow_stub.url, workers)
    served.wait_until_healthy()
    # every worker serving: one still starting has no handler yet (a Ctrl-C there is a traceback)
    served.wait_until("Application startup complete.", count=workers)
    sid = httpx.post(f"{served.url}/sessions", timeout=30).json()["session_id"]
    before = len(slow_stub.chat_requests())
    reply: list[httpx.Response] = []
    body = {"messages": [{"role": "user", "content": "hi"}]}
    turn = threading.Thread(
        target=lambda: reply.append(httpx.post(f"{served.url}/sessions/{sid}/v1/chat/completions", json=body, timeout=30))
    )
    turn.start()
    deadline = time.monotonic() + 30
    while len(slow_stub.chat_requests()) == before:  # the turn has reached the engine
        assert time.monotonic() < deadline, served.stderr()
        time.sleep(0.01)
    served.signal(sig, group=group)
    turn.join(30)
    assert reply and reply[0].status_code == 200, (reply, served.stderr())
    assert reply[0].json()["choices"][0]["message"]["content"].startswith("#1 ")
    assert served.exit_status() == 0, served.stderr()
    assert_clean(served)
    assert_port_free(served.port)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_second_sigint_during_the_shutdown_exits_at_once_with_130(serve, chat_tokenizer, workers) -> None:
    with StubEngine(ScriptedChat(chat_tokenizer), delay_s=60.0) as stub:  # a turn that outlasts the test
        served = serve(stub.url, workers)
        served.wait_until_healthy()
        sid = httpx.post(f"{served.url}/sessions", timeout=30).json()["session_id"]
        body = {"messages": [{"role": "user", "content": "hi"}]}

        def turn() -> None:
            try:
                httpx.post(f"{served.url}/sessions/{sid}/v1/chat/completions", json=body, timeout=90)
            except httpx.TransportError:
                pass  # the server went away mid-turn: what the second SIGINT asks for

        threading.Thread(target=turn, daemon=True).start()
        deadline = time.monotonic() + 30
        while not stub.chat_requests():
            assert time.monotonic() < deadline, served.stderr()
            time.sleep(0.01)
        served.signal(signal.SIGINT)
        served.wait_until("Waiting for connections to close")  # the graceful shutdown waits for the turn
        started = time.monotonic()
        served.signal(signal.SIGINT)
        assert served.exit_status() == 130, served.stderr()
        assert time.monotonic() - started < 10
        assert_clean(served)
        assert_port_free(served.port)
