"""uvicorn servers that a stop signal ends as a normal return (exit status 0).

``miles session serve`` and ``miles engine serve`` run uvicorn in the main thread; see
:class:`SignalStopped` for why uvicorn's own handling reports a failure there.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

from miles_core.errors import INTERRUPTED

if TYPE_CHECKING:
    import uvicorn

#: the signals that stop a server gracefully
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalStopped:
    """A ``uvicorn.Server`` mixin: stopped by a signal, the server returns from ``run()`` like any
    server that was asked to stop (``miles session serve``, ``miles engine serve``: exit status 0).

    uvicorn's own server, run in the main thread, catches SIGINT and SIGTERM, shuts down
    gracefully -- no new connections, the requests in flight answered, the app's lifespan
    shutdown -- and then raises the signal again: SIGINT becomes a ``KeyboardInterrupt`` (click
    prints "Aborted!", status 1) and SIGTERM kills the process (status -15), so a server that
    stopped as asked reports a failure. This one catches the same signals, shuts down the same
    way and does not raise them again.

    A SIGINT while that shutdown waits (Ctrl-C pressed again) ends the process at once with
    :data:`~miles_core.errors.INTERRUPTED`, without waiting for the requests in flight -- unless
    ``interrupt_exits`` is off: a worker of several leaves that to its parent, which gets the same
    Ctrl-C (:func:`~miles_core.session.workers.serve_workers`). Another SIGTERM changes nothing.
    In any other thread (:func:`~miles_core.session.embed.run_app_in_thread`, an engine server's
    ``start()``) no signal is caught, as with uvicorn's own.
    """

    should_exit: bool
    interrupt_exits = True

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only: whoever runs the server stops it
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT and self.should_exit and self.interrupt_exits:
            os.write(2, b"interrupted again: exiting without waiting for the requests in flight\n")
            os._exit(INTERRUPTED)
        self.should_exit = True


@functools.cache
def signal_stopped_server() -> type[uvicorn.Server]:
    """``uvicorn.Server`` with :class:`SignalStopped` (``miles engine serve``'s)."""
    import uvicorn

    class SignalStoppedServer(SignalStopped, uvicorn.Server):
        pass

    return SignalStoppedServer
