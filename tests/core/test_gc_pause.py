"""gc_paused: no automatic collection inside, the collector's state restored on every way out;
the entry point's exit: garbage finalized, then the rest frozen."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from miles_core import __version__
from miles_core.ci.register import register_cpu_ci
from miles_core.gc_pause import gc_paused

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    """Each test starts with the collector on and leaves it on, whatever it did."""
    gc.enable()
    yield
    gc.enable()


def _automatic_collections(work: int) -> int:
    """How many collections the collector started by itself while ``work`` cyclic objects were made."""
    started: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(count)
    try:
        keep = []
        for _ in range(work):
            node: list[object] = []
            node.append(node)
            keep.append(node)
    finally:
        gc.callbacks.remove(count)
    return len(started)


def test_no_automatic_collection_inside_and_collection_resumes_after() -> None:
    work = 50 * gc.get_threshold()[0]
    assert _automatic_collections(work) > 0  # the control: this much allocation does trigger collections
    with gc_paused():
        assert not gc.isenabled()
        assert _automatic_collections(work) == 0
    assert gc.isenabled()
    assert _automatic_collections(work) > 0


def test_state_restored_when_the_block_raises() -> None:
    with pytest.raises(ZeroDivisionError), gc_paused():
        assert not gc.isenabled()
        1 / 0  # noqa: B018
    assert gc.isenabled()


def test_state_restored_when_the_block_is_interrupted() -> None:
    with pytest.raises(KeyboardInterrupt), gc_paused():
        raise KeyboardInterrupt
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled() -> None:
    gc.disable()
    with gc_paused():
        gc.enable()  # code inside turning it on does not outlive the pause
    assert not gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("inside")
    assert not gc.isenabled()


def test_an_inner_pause_does_not_enable_under_an_outer_one() -> None:
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
        with pytest.raises(ValueError), gc_paused():
            raise ValueError
        assert not gc.isenabled()
    assert gc.isenabled()


def test_overlapping_pauses_in_two_threads_restore_once_both_end() -> None:
    inside, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)
        seen.append(gc.isenabled())

    thread = threading.Thread(target=other)
    with gc_paused():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # this thread's pause ended first: the other one still holds it
    release.set()
    thread.join(10)
    assert seen == [True] and gc.isenabled()


EXIT_PROBE = """
import atexit, gc, sys
from miles_core.cli import main

gc.disable()
frozen_before = gc.get_freeze_count()  # a host's site customisation may have frozen its start-up

class Cycle:
    def __del__(self):
        print("finalized", file=sys.stderr, flush=True)

garbage = Cycle()
garbage.self = garbage
del garbage
# registered before main(): runs after whatever main() registers
atexit.register(lambda: print("frozen", gc.get_freeze_count() > frozen_before, file=sys.stderr, flush=True))
sys.argv = ["miles", "--version"]
main(ARGV)
"""


def _exit_probe(argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", EXIT_PROBE.replace("ARGV", argv)], capture_output=True, text=True, timeout=60
    )


def test_the_entry_point_finalizes_garbage_then_freezes_at_exit() -> None:
    # the collector is off: only an explicit collection finalizes the cycle before the handler
    done = _exit_probe("")
    assert (done.returncode, done.stdout.strip()) == (0, f"miles {__version__}")
    assert done.stderr.split() == ["finalized", "frozen", "True"]


def test_a_caller_passing_argv_keeps_its_collector() -> None:
    done = _exit_probe('["--version"]')
    assert (done.returncode, done.stdout.strip()) == (0, f"miles {__version__}")
    assert done.stderr.split()[:2] == ["frozen", "False"]  # (the cycle is left to the shutdown's collection)
