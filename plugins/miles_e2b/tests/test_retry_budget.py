"""One retry budget across the SDK and miles, checked with the real e2b SDK against a loopback
server that throttles every request (and echoes the API key back, as a hostile error would):
a throttled create makes exactly the lifecycle policy's attempts; the SDK adds none of its own.
The error that surfaces carries no key: not in its text, nor anywhere in its ``__cause__`` /
``__context__`` chain. With the SDK's own retries left on (negative control) the same create
makes four requests per attempt."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from miles_e2b import config as e2b_config
from miles_e2b.config import E2BConfig
from miles_e2b.provider import E2BProvider

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.errors import SandboxThrottled
from miles_core.sandbox.lifecycle import SandboxManager
from miles_core.sandbox.retry import RetryPolicy

register_cpu_ci(est_time=6, suite="stage-a-cpu")

PLANTED = "e2b_" + "5ec7e7" * 6 + "5ec7"
ATTEMPTS = 4


class Throttling(BaseHTTPRequestHandler):
    requests: list[str]

    def _answer(self) -> None:
        self.requests.append(f"{self.command} {self.path}")
        body = json.dumps({"code": 429, "message": f"rate limit for key {self.headers.get('X-API-Key')}"})
        self.send_response(429)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def throttling() -> Iterator[tuple[str, list[str]]]:
    requests: list[str] = []
    handler = type("Handler", (Throttling,), {"requests": requests})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    stack = [error]
    while stack:
        item = stack.pop()
        if item in seen:
            continue
        seen.append(item)
        stack += [e for e in (item.__cause__, item.__context__) if e is not None]
    return seen


def _create(url: str, key_file: Path) -> SandboxThrottled:
    config = E2BConfig.from_options(
        {"preset": "agentenv", "api_url": url, "domain": "127.0.0.1.sslip.io", "api_key": f"file:{key_file}"}
    )
    provider = E2BProvider(config)  # the real SDK

    async def main() -> SandboxThrottled:
        manager = SandboxManager(
            provider, retry=RetryPolicy(attempts=ATTEMPTS, base_s=0.001, cap_s=0.002), keepalive=False
        )
        with pytest.raises(SandboxThrottled) as raised:
            await manager.create()
        await manager.aclose()
        return raised.value

    return asyncio.run(main())


def test_a_throttled_create_makes_the_policys_attempts_and_no_more(
    throttling: tuple[str, list[str]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, requests = throttling
    key_file = tmp_path / "key"
    key_file.write_text(PLANTED)
    with caplog.at_level(logging.DEBUG):
        error = _create(url, key_file)
    assert caplog.records and PLANTED not in caplog.text
    creates = [r for r in requests if r.startswith("POST") and r.endswith("/sandboxes")]
    assert len(creates) == ATTEMPTS, requests
    assert "429" in str(error)
    for item in _chain(error):
        assert PLANTED not in "".join(traceback.format_exception(item)) and PLANTED not in repr(item.args)
    assert error.__context__ is None and error.__cause__ is None


def test_negative_control_the_sdks_own_retries_multiply_requests(
    throttling: tuple[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, requests = throttling
    key_file = tmp_path / "key"
    key_file.write_text(PLANTED)
    original = e2b_config.E2BConfig.api_params

    def with_sdk_retries(self: E2BConfig, key):  # type: ignore[no-untyped-def]
        params = original(self, key)
        params.pop("retries")
        return params

    monkeypatch.setattr(e2b_config.E2BConfig, "api_params", with_sdk_retries)
    _create(url, key_file)
    assert len([r for r in requests if r.startswith("POST") and r.endswith("/sandboxes")]) == 4 * ATTEMPTS, requests
