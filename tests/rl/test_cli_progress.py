"""The progress display: a bar on a terminal whose clock counts from the run's start and keeps its
width at 80 columns; one line per step without a terminal."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.metrics import Progress

register_cpu_ci(est_time=9, suite="stage-a-cpu")

RECORD = {"step": 2, "reward_mean": 0.125, "greedy_accuracy": 0.11, "logprob_mismatch_max": 1.2e-6,
          "tokens_per_s": 2400.0}


def _render(width: int, terminal: bool, started_ago: float = 83.4) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=terminal, color_system=None)
    progress = Progress(60, 0, True, time.perf_counter() - started_ago, console=console)
    progress.update(RECORD)
    progress.close()
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 60, 120])
def test_the_bar_keeps_the_clock_and_the_count_whole(width):
    last = _render(width, terminal=True).split("\r")[-1]
    assert "3/60" in last and "0:01:23" in last  # the clock counts from the run's start, not the bar's
    assert "reward 0." in last  # the live numbers give way (ellipsis) before anything else does


def test_without_a_terminal_each_step_is_one_line():
    assert _render(80, terminal=False) == "train 3/60 0:01:23 reward 0.125 | acc 0.11 | mismatch 1.2e-06 | 2400 tok/s\n"


def test_a_stop_request_shows_on_the_bar():
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=True, color_system=None)
    progress = Progress(60, 0, True, console=console)
    progress.stopping()  # what the SIGINT handler calls: a flag, no I/O on a terminal
    progress.update(RECORD)
    progress.close()
    assert "stopping after this step (Ctrl-C again aborts)" in out.getvalue().split("\r")[-1]


def test_the_clock_starts_at_the_process_start_when_python_started_with_it() -> None:
    from miles_core.rl.cli import clock_origin

    assert clock_origin(now=100.0, imported_at=99.0, process_started=98.9) == 98.9
    # a shell exec'd `miles train` after running pip for 28 s in the same process
    assert clock_origin(now=100.0, imported_at=99.0, process_started=71.0) == 99.0
    assert clock_origin(now=100.0, imported_at=99.0, process_started=None) == 99.0  # no /proc
    # a test runner or notebook that imported miles long ago: the run starts now
    assert clock_origin(now=100.0, imported_at=40.0, process_started=39.9) == 100.0


def test_a_command_exec_d_by_a_shell_counts_only_its_own_start_up() -> None:
    """``bash -c 'sleep 6 && miles ...'`` runs miles in the shell's process, 6 s old by then."""
    import subprocess
    import sys

    probe = "import time; from miles_core.rl.cli import _clock_origin; print(time.perf_counter() - _clock_origin())"
    done = subprocess.run(["bash", "-c", f'sleep 6 && exec "{sys.executable}" -c "{probe}"'],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 0 <= float(done.stdout) < 5, done.stdout  # Python's own start-up and imports, not the sleep
