"""A Ctrl-C while a run shuts down: the close waits for it, and what is interrupted anyway
(another Ctrl-C) leaves nothing half closed.

The run's background event loop: `miles train` closes the loop from the main thread, where a second Ctrl-C raises
KeyboardInterrupt at whatever line is running. Each line `BackgroundLoop.close()` executes is
interrupted in turn (a trace function raises there, as a signal handler would): afterwards the
loop must be closed once the cleanup is retried, and nothing may be printed at exit -- a loop left
half closed is closed again by its finalizer ("Exception ignored in BaseEventLoop.__del__ ...
Invalid file descriptor: -1").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.loop import StopRequest

register_cpu_ci(est_time=3, suite="stage-a-cpu")

SWEEP = textwrap.dedent(
    """
    import gc, json, sys
    from miles_core.rl.aio import BackgroundLoop

    def interrupt_at(point):
        seen = 0
        def trace(frame, event, arg):
            nonlocal seen
            if event == "line":
                seen += 1
                if seen == point:
                    raise KeyboardInterrupt
            return trace
        return trace

    outcomes = {}
    point = 0
    while True:
        point += 1
        aio = BackgroundLoop()
        aio.run(aio.loop.shutdown_asyncgens())  # the loop has run work, as a run's has
        sys.settrace(interrupt_at(point))
        try:
            aio.close()
        except KeyboardInterrupt:
            pass
        else:
            break  # every line was interrupted once
        finally:
            sys.settrace(None)
        try:
            aio.close()  # a cleanup that runs again
            outcomes[point] = "closed" if aio.loop.is_closed() else "not closed"
        except Exception as exc:
            outcomes[point] = f"{type(exc).__name__}: {exc}"
        del aio
        gc.collect()  # a half-closed loop's finalizer would complain now
    print(json.dumps({"points": point - 1, "outcomes": outcomes}))
    """
)


def test_close_interrupted_at_any_line_still_closes_the_loop_and_prints_nothing() -> None:
    done = subprocess.run([sys.executable, "-c", SWEEP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["points"] >= 5, report  # close() really ran lines that were interrupted
    bad = {point: outcome for point, outcome in report["outcomes"].items() if outcome != "closed"}
    assert bad == {}, bad
    assert done.stderr == "", done.stderr


def test_close_is_idempotent_and_the_loop_runs_until_then() -> None:
    aio = BackgroundLoop()

    async def answer() -> int:
        return 42

    assert aio.run(answer(), timeout=10) == 42
    aio.close()
    assert aio.loop.is_closed()
    aio.close()


#: a process started with SIGINT ignored (nohup, a background job) has no Ctrl-C to handle
needs_sigint = pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is signal.SIG_IGN, reason="SIGINT is ignored in this process"
)


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):  # the handler runs between bytecodes of this thread
        pass


@needs_sigint
def test_a_ctrl_c_while_closing_is_raised_once_the_close_has_finished() -> None:
    steps: list[str] = []
    with StopRequest() as stop, pytest.raises(KeyboardInterrupt), stop.closing():
        _ctrl_c()
        steps.append("closed the rest")
    assert steps == ["closed the rest"]


@needs_sigint
def test_another_ctrl_c_interrupts_the_close_itself() -> None:
    steps: list[str] = []
    with StopRequest() as stop, pytest.raises(KeyboardInterrupt), stop.closing():
        _ctrl_c()
        steps.append("after the first")
        _ctrl_c()
        steps.append("after the second")
    assert steps == ["after the first"]


@needs_sigint
def test_a_failing_close_is_not_masked_by_a_waiting_ctrl_c() -> None:
    with StopRequest() as stop, pytest.raises(RuntimeError, match="closer failed"), stop.closing():
        _ctrl_c()
        raise RuntimeError("closer failed")


class _Handled:
    """An ``after_summary`` handler that records its calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, signum: int, frame: object) -> None:
        self.calls.append(signum)


@needs_sigint
def test_a_ctrl_c_after_the_summary_waits_for_the_close_and_goes_to_after_summary() -> None:
    after, steps = _Handled(), []
    with StopRequest(after) as stop:
        stop.summarised()
        _ctrl_c()  # between the summary's write and the close: held, not raised into the loop's tail
        steps.append("reached the close")
        with stop.closing():
            steps.append("closed")
        assert after.calls == [signal.SIGINT]
    assert steps == ["reached the close", "closed"]


@needs_sigint
def test_without_after_summary_a_held_ctrl_c_is_raised_once_closed() -> None:
    steps: list[str] = []
    with StopRequest() as stop, pytest.raises(KeyboardInterrupt):
        stop.summarised()
        _ctrl_c()
        steps.append("reached the close")
        with stop.closing():
            steps.append("closed")
    assert steps == ["reached the close", "closed"]


@needs_sigint
def test_after_the_summary_the_caller_keeps_after_summary_as_its_handler() -> None:
    """The run's objects are torn down after the loop's handler leaves: a Ctrl-C there must reach
    ``after_summary``, not the caller's previous handler (Python's raises into finalizers)."""
    after = _Handled()
    previous = signal.getsignal(signal.SIGINT)
    try:
        with StopRequest(after) as stop:
            stop.summarised()
        assert signal.getsignal(signal.SIGINT) is after
        _ctrl_c()
        assert after.calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


@needs_sigint
def test_a_run_that_never_wrote_its_summary_gives_the_previous_handler_back() -> None:
    after = _Handled()
    previous = signal.getsignal(signal.SIGINT)
    with StopRequest(after):
        pass
    assert signal.getsignal(signal.SIGINT) is previous and after.calls == []


@needs_sigint
def test_a_ctrl_c_between_the_close_and_the_end_is_acted_on_at_the_end() -> None:
    after = _Handled()
    previous = signal.getsignal(signal.SIGINT)
    try:
        with StopRequest(after) as stop:
            stop.summarised()
            with stop.closing():
                pass
            _ctrl_c()
            assert after.calls == []
        assert after.calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
