"""Shard planning quality and registration discovery speed; prints one JSON line.

Planner vs plain longest-first greedy (LPT), both measured here on the same synthetic suites:
50, 200 and 500 files with heavy-tailed est_times (log-normal and Pareto), 2-8 shards, 10 seeds
each. Reported per case: the worst and mean makespan / lower-bound ratio of each. Target: the
planner's worst <= 1.05 and never worse than greedy.

Small suites against the true optimum: 300 random suites of 3-40 files on 2-4 shards (est_times
log-normal, Pareto or uniform whole seconds), each solved exactly by the HiGHS MILP solver
(``highspy``, the ``bench`` extra) as the reference. Reported: the worst and mean makespan /
optimum of the planner, of the planner without its exact search (local moves only), and of plain
greedy, and how many plans the planner proved optimal. Target: the planner's worst <= 1.03.

Discovery: 500 registered test files of about 5 KB written to a temporary tree, then found
and parsed (median of 5 runs); the full catalog load (suites file, hardware kinds, validation) is reported
too. Target: discovery < 1 s.

Usage: python benchmarks/ci_sharding.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from miles_core.ci.discovery import Marker, discover, find_test_files
from miles_core.ci.sharding import greedy_shards, plan_shards

SIZES = (50, 200, 500)
SHARDS = range(2, 9)
SEEDS = 10
TARGET = 1.05
SMALL_SUITES = 300
SMALL_TARGET = 1.03


def synthetic_times(rng: random.Random, files: int, distribution: str) -> list[float]:
    if distribution == "lognormal":
        return [float(max(1, round(rng.lognormvariate(3.0, 1.5)))) for _ in range(files)]
    return [float(max(1, round(5 * rng.paretovariate(1.16)))) for _ in range(files)]


def sharding() -> tuple[list[dict], bool]:
    cases, never_worse = [], True
    for files in SIZES:
        for shards in SHARDS:
            planner, greedy = [], []
            for seed in range(SEEDS):
                for distribution in ("lognormal", "pareto"):
                    rng = random.Random(f"{distribution}-{files}-{shards}-{seed}")
                    items = [
                        (f"tests/test_{i:04d}.py", t)
                        for i, t in enumerate(synthetic_times(rng, files, distribution))
                    ]
                    plan, base = plan_shards(items, shards), greedy_shards(items, shards)
                    never_worse &= plan.makespan <= base.makespan
                    planner.append(plan.ratio)
                    greedy.append(base.ratio)
            cases.append(
                {
                    "files": files,
                    "shards": shards,
                    "planner_worst": round(max(planner), 4),
                    "planner_mean": round(statistics.fmean(planner), 4),
                    "greedy_worst": round(max(greedy), 4),
                    "greedy_mean": round(statistics.fmean(greedy), 4),
                }
            )
    return cases, never_worse


def optimum(times: list[float], shards: int) -> float:
    """The smallest makespan, from HiGHS: binary x[i][j] (file i on shard j), minimise C with
    every file on one shard and every shard's load <= C."""
    import highspy

    model = highspy.Highs()
    model.setOptionValue("output_flag", False)
    model.setOptionValue("mip_rel_gap", 0.0)
    x = [[model.addBinary() for _ in range(shards)] for _ in times]
    makespan = model.addVariable(lb=0.0)
    for row in x:
        model.addConstr(sum(row) == 1)
    for j in range(shards):
        model.addConstr(sum(t * x[i][j] for i, t in enumerate(times)) - makespan <= 0)
    model.minimize(makespan)
    if model.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"HiGHS did not prove an optimum: {model.modelStatusToString(model.getModelStatus())}")
    return model.getInfo().objective_function_value


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """HiGHS prints a banner on stdout from C++; this script's stdout is one JSON line."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def small_suites() -> dict:
    with stdout_to_stderr():
        return _small_suites()


def _small_suites() -> dict:
    from miles_core.ci import sharding

    planner, local, greedy, proved, seconds = [], [], [], 0, []
    for seed in range(SMALL_SUITES):
        rng = random.Random(f"small-{seed}")
        files, shards = rng.randint(3, 40), rng.randint(2, 4)
        distribution = ("lognormal", "pareto", "uniform")[seed % 3]
        times = (
            [float(rng.randint(1, 600)) for _ in range(files)]
            if distribution == "uniform"
            else synthetic_times(rng, files, distribution)
        )
        items = [(f"tests/test_{i:02d}.py", t) for i, t in enumerate(times)]
        best = optimum(times, shards)
        started = time.perf_counter()
        plan = plan_shards(items, shards)
        seconds.append(time.perf_counter() - started)
        exact_max, sharding.EXACT_MAX_FILES = sharding.EXACT_MAX_FILES, 0
        try:
            moves = plan_shards(items, shards)
        finally:
            sharding.EXACT_MAX_FILES = exact_max
        planner.append(plan.makespan / best)
        local.append(moves.makespan / best)
        greedy.append(greedy_shards(items, shards).makespan / best)
        proved += plan.optimal
        if plan.makespan < best - 1e-6:
            raise AssertionError(f"suite {seed}: planner {plan.makespan} below the MILP optimum {best}")
    return {
        "suites": SMALL_SUITES,
        "planner_worst": round(max(planner), 4),
        "planner_mean": round(statistics.fmean(planner), 5),
        "local_moves_worst": round(max(local), 4),
        "local_moves_mean": round(statistics.fmean(local), 5),
        "greedy_worst": round(max(greedy), 4),
        "greedy_mean": round(statistics.fmean(greedy), 5),
        "proved_optimal": proved,
        "plan_s_max": round(max(seconds), 3),
        "target": SMALL_TARGET,
        "meets_target": max(planner) <= SMALL_TARGET,
    }


TEST_HEAD = '''"""Synthetic test file {i}: a registration, then a few kilobytes of tests."""

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time={est}, suite="stage-a-cpu"{labels})


@pytest.fixture
def value():
    return {i}
'''

TEST_CASE = '''

@pytest.mark.parametrize("x", [1, 2, 3])
def test_case_{n}(x, value):
    """Case {n}: arithmetic on the fixture value."""
    total = sum(range(x * value % 13))
    assert total >= 0, f"negative total {{total}}"
    items = {{k: k * x for k in range(5)}}
    assert sorted(items) == list(range(5))
    assert all(v >= 0 for v in items.values())
'''

CASES_PER_FILE = 15  # about 5 KB per file, the size of this repository's test files


def discovery(files: int = 500) -> dict:
    from miles_core.ci.builtin import CPU
    from miles_core.ci.catalog import load_catalog
    from miles_core.testing.isolation import isolated_plugin_manager

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "pyproject.toml").write_text(
            '[tool.miles.ci]\npaths = ["tests"]\n[tool.miles.ci.labels]\nslow = "slow"\n'
            '[tool.miles.ci.suites.stage-a-cpu]\nhardware = "cpu"\nruns-on = ["ubuntu-latest"]\nshards = 4\n'
        )
        for i in range(files):
            path = root / "tests" / f"area_{i % 20:02d}" / f"test_{i:04d}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            labels = ', labels=["slow"]' if i % 9 == 0 else ""
            body = "".join(TEST_CASE.format(n=n) for n in range(CASES_PER_FILE))
            path.write_text(TEST_HEAD.format(i=i, est=1 + i % 97, labels=labels) + body)
        size = len(path.read_text())
        markers = {CPU.marker_name: Marker(CPU.marker_name, "cpu", CPU.marker_parameters())}
        discover_times, catalog_times = [], []
        for _ in range(5):
            started = time.perf_counter()
            found = find_test_files(root, ["tests"], ["test_*.py"])
            registrations, problems = discover(root, found, markers)
            discover_times.append(time.perf_counter() - started)
            assert len(registrations) == files and not problems
            with isolated_plugin_manager(builtins=True) as pm:
                started = time.perf_counter()
                load_catalog(root, pm=pm)
                catalog_times.append(time.perf_counter() - started)
    seconds = statistics.median(discover_times)
    return {
        "files": files,
        "bytes_per_file": size,
        "discovery_s": round(seconds, 4),
        "catalog_load_s": round(statistics.median(catalog_times), 4),
        "under_1s": seconds < 1.0,
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if importlib.util.find_spec("highspy") is None:
        sys.exit("ci_sharding.py needs highspy for the exact optimum, the bench extra: pip install -e '.[bench]'")
    load_before = os.getloadavg()[0]
    cases, never_worse = sharding()
    planner_worst = max(c["planner_worst"] for c in cases)
    greedy_worst = max(c["greedy_worst"] for c in cases)
    result = {
        "benchmark": "ci_sharding",
        "suites": "files in {50, 200, 500} x shards 2..8 x 10 seeds x {lognormal(3, 1.5), pareto(1.16)*5 s}",
        "cases": cases,
        "planner_worst_ratio": planner_worst,
        "greedy_worst_ratio": greedy_worst,
        "ratio": round(planner_worst / greedy_worst, 4),
        "target": TARGET,
        "meets_target": planner_worst <= TARGET,
        "never_worse_than_greedy": never_worse,
        "small_vs_optimum": small_suites(),
        "discovery": discovery(),
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
