import os
import time

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.plot_worker import PlotWorker, PlotWorkerError

register_cpu_ci(est_time=8, suite="stage-a-cpu")

pytest.importorskip("matplotlib", reason="plotting needs the train extra (matplotlib)")

RECORDS = [
    {"step": s, "reward_mean": 0.1 * s, "greedy_accuracy": 0.1 * s if s % 2 == 0 else None, "response_length_mean": 1.0,
     "time_train": 0.05, "time_rollout_direct": 0.02, "time_step": 0.08, "tokens_per_s": 100.0 + s}
    for s in range(5)
]


def test_the_worker_writes_the_png_plot_run_writes(tmp_path):
    from miles_core.rl.metrics import plot_run

    worker = PlotWorker()
    assert worker.render(RECORDS, tmp_path / "plot.png", "t", (5, 1.0)) == tmp_path / "plot.png"
    plot_run(RECORDS, tmp_path / "direct.png", "t", (5, 1.0))
    png = (tmp_path / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert png == (tmp_path / "direct.png").read_bytes()
    with pytest.raises(PlotWorkerError, match="already used"):
        worker.render(RECORDS, tmp_path / "again.png", "t")


def test_a_failing_render_raises_with_the_workers_error(tmp_path):
    worker = PlotWorker()
    with pytest.raises(PlotWorkerError, match=r"(?s)failed to write .*KeyError: 'step'"):
        worker.render([{"reward_mean": 1.0}], tmp_path / "plot.png", "t")
    assert not (tmp_path / "plot.png").exists()


def test_the_worker_is_out_of_the_terminals_reach_and_close_stops_it():
    worker = PlotWorker()
    proc = worker._proc
    assert proc is not None
    # its own session and process group: a Ctrl-C at the terminal does not reach it
    assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
    started = time.perf_counter()
    worker.close()
    assert proc.returncode is not None and time.perf_counter() - started < 5
    worker.close()  # twice is fine
