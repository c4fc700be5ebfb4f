"""One asyncio event loop on a background thread, shared by the async parts of a run.

The loop is synchronous and readable top to bottom; the session-server client and sandbox
providers are async. They all run on this loop, so their connections and objects stay bound to
one event loop for the whole run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: how often close() looks whether the loop's thread has closed the loop
CLOSE_POLL_S = 0.005


class BackgroundLoop:
    def __init__(self, name: str = "miles-rl-aio") -> None:
        self.loop = asyncio.new_event_loop()
        self._finished = False  # set by the loop's thread once it has closed the loop
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # Closed here, by the thread that ran it, never by the caller of close(): that is the
        # main thread, where a KeyboardInterrupt (a second Ctrl-C while the run shuts down) may
        # land at any line of ``loop.close()`` and leave the loop half closed -- its finalizer
        # then closes it again at exit ("Exception ignored in BaseEventLoop.__del__ ... Invalid
        # file descriptor: -1"). No signal handler runs on this thread.
        try:
            self.loop.run_forever()
        finally:
            try:
                self.loop.close()
            finally:
                self._finished = True

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the background loop and wait for its result (exceptions propagate)."""
        return self.submit(coro).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the background loop; its result (or exception) arrives in the future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the loop and wait until its thread has closed it. Idempotent; interrupted (Ctrl-C),
        the thread still closes the loop, and calling it again waits for that."""
        if not self.loop.is_closed():  # again when retried: an interrupted request may not have woken it
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:
                if not self.loop.is_closed():  # else its thread closed it meanwhile: nothing to stop
                    raise
        # Polled: interrupted at the wrong line, Thread.join() marks a running thread as ended
        # and Event.wait() raises "release unlocked lock" instead (CPython 3.11); a sleep holds
        # no state an interrupt could corrupt.
        while not self._finished:
            time.sleep(CLOSE_POLL_S)
