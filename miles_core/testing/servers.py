"""Helpers for tests that run a miles server (``miles engine serve``, ``miles session serve``) as a
subprocess: wait for it to answer, and check that it let go of its port."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable


def wait_until_healthy(url: str, process: subprocess.Popen[str], timeout: float = 60.0,
                       describe: Callable[[], str] = str) -> None:
    """Poll ``GET {url}/health`` until it answers 200; fails (with ``describe()``) when ``process``
    exits first or ``timeout`` s pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and process.poll() is None, describe()
        time.sleep(0.02)


def assert_port_free(port: int) -> None:
    """Nothing listens on ``port`` any more: a new listener can take it. (SO_REUSEADDR, as the
    servers set it: closed connections may linger in TIME_WAIT on the port, which only a listener
    that is still open should stop.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
