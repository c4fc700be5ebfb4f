"""``miles engine serve`` stops on SIGINT or SIGTERM like a command that finished: a generation in
flight is answered, the engine is closed, the port is released and the status is 0 (no click
"Aborted!", no death by the signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.testing.servers import assert_port_free, wait_until_healthy

register_cpu_ci(est_time=12, suite="stage-a-cpu")


def _serve(tiny_dir: Path, log_level: str = "info") -> tuple[subprocess.Popen[str], str]:
    """The real command on a free port, once it answers GET /health (its stderr is read only
    once it exits: at ``info`` it logs every request, so poll it at ``warning``)."""
    env = {**os.environ, "MILES_CACHE_DIR": str(tiny_dir.parent)}
    argv = [sys.executable, "-m", "miles_core", "engine", "serve", "--preset", "tiny", "--port", "0", "--log-level", log_level]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("miles engine: serving tiny at http://"), (line, _finish(process)[1])
    url = line.split(" at ")[1].split(" ")[0]
    wait_until_healthy(url, process, describe=lambda: _finish(process)[1])
    return process, url


def _finish(process: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str]:
    """The exit status and the whole stderr (killed after ``timeout`` s)."""
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{err}") from None
    return process.returncode, err


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, id="SIGINT"), pytest.param(signal.SIGTERM, id="SIGTERM")])
def test_a_signal_stops_the_engine_with_status_0_and_frees_the_port(tiny_dir, sig) -> None:
    process, url = _serve(tiny_dir)
    try:
        process.send_signal(sig)
        code, err = _finish(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 0, err
    assert "Aborted!" not in err and "Traceback" not in err, err
    assert "Shutting down" in err
    assert_port_free(int(url.rsplit(":", 1)[1]))


def test_a_generation_in_flight_is_answered_before_the_engine_exits(tiny_dir) -> None:
    process, url = _serve(tiny_dir, log_level="warning")
    try:
        reply: list[httpx.Response] = []
        body = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2000, "ignore_eos": True, "seed": 0}
        chat = threading.Thread(target=lambda: reply.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)))
        chat.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health", timeout=10).json()["running"] == 0:  # ~1 s of decoding on CPU
            assert time.monotonic() < deadline and not reply, reply
            time.sleep(0.005)
        process.send_signal(signal.SIGTERM)
        chat.join(60)
        code, err = _finish(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert reply and reply[0].status_code == 200, (reply, err)
    assert reply[0].json()["usage"]["completion_tokens"] == 2000
    assert code == 0, err
    assert "Aborted!" not in err and "Traceback" not in err, err
    assert_port_free(int(url.rsplit(":", 1)[1]))
