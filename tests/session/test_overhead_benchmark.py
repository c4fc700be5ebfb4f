"""``benchmarks/session_overhead.py`` at a tiny scale: it runs interleaved direct/session rounds
and reports what its numbers need to be read: the throughput ratio per round, every process's
CPU per turn, the machine's idle share and the load average, and that no turn was lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=20, suite="stage-a-cpu")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "session_overhead.py"


@pytest.mark.parametrize(("workers", "workers_cpu"), [
    (["--workers", "1"], set()), (["--workers", "2"], {"session_worker0", "session_worker1"}),
])
def test_the_benchmark_reports_throughput_and_the_load_it_ran_under(workers: list[str], workers_cpu: set[str]) -> None:
    done = subprocess.run(
        # 160 turns: enough CPU for each worker's share to show in /proc's 10 ms ticks
        [sys.executable, str(SCRIPT), "--sessions", "16", "--turns", "10", "--stub-delay-ms", "20",
         "--rounds", "2", "--skip-assembly", *workers],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sessions"] == 16 and result["rounds"] == 2 and result["lost_records"] == 0
    assert len(result["throughput_ratios"]) == 2 and 0 < result["throughput_ratio"] <= 2
    assert result["turns_per_s"] > 0 and result["direct_turns_per_s"] > 0
    for run in ("direct", "session"):
        assert set(result["cpu_ms_per_turn"][run]) == {"load_generator", "session_server", "stub"}
        assert 0 <= result["machine_idle"][run] <= 1
    assert result["server_cpu_ms_per_turn"] == result["cpu_ms_per_turn"]["session"]["session_server"] > 0
    assert result["workers"] == int(workers[1])
    assert set(result["worker_cpu_ms_per_turn"]) == workers_cpu  # per worker, when there are several
    if workers_cpu:
        assert all(ms > 0 for ms in result["worker_cpu_ms_per_turn"].values())  # every worker served
        assert sum(result["worker_cpu_ms_per_turn"].values()) == pytest.approx(result["server_cpu_ms_per_turn"], abs=0.004)
    assert len(result["load_avg_1m"]) == 2 and result["cpu_count"] >= 1
    assert "assembly_32k_ms" not in result


def test_bad_arguments_exit_2() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--sessions", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--sessions must be >= 1" in done.stderr
