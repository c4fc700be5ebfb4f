"""Run a coroutine to completion from synchronous code, inside or outside an event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``; from a thread that already runs a loop, on a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="miles-sandbox-run-sync")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
