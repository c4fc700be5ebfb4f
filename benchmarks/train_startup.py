"""``miles train --preset tiny``: its wall time, its start-up and the floor start-up cannot go below.

Interleaved, ``--runs`` times each:

* the preset (``--no-progress --json``, a fresh run directory each time): the command's wall
  time, and from its summary ``seconds`` (process start to the summary), ``startup_s`` (process
  start to the first step, :func:`miles_core.rl.loop.train`) and ``startup_share``;
* the floor: ``python -c "import torch"`` and ``python -c "import torch, <the Qwen3.5 modeling
  module>"`` -- what any process that trains the tiny preset's model with transformers imports
  before it can do anything.

Headlines: medians of the preset's wall time and start-up share; targets (issue 18): wall <= 8 s
on an idle 2-core machine, share <= 0.15. ``floor_share`` is the share start-up would have with
nothing but the floor imports before the loop: ``floor / (floor + median loop seconds)``, the
lowest share reachable while the run imports torch and transformers.

Prints one JSON line. Usage::

    python benchmarks/train_startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_SECONDS, TARGET_SHARE = 8.0, 0.15
QWEN35 = "transformers.models.qwen3_5.modeling_qwen3_5"


def _timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{command} failed:\n{proc.stderr[-3000:]}")
    return seconds, proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.perf_counter()
    runs, torch_s, floor_s = [], [], []
    with tempfile.TemporaryDirectory(prefix="miles-startup-bench-") as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run-{i}"
            load = os.getloadavg()[0]
            wall, proc = _timed([sys.executable, "-m", "miles_core", "train", "--preset", "tiny", "--out", str(out),
                                 "--no-progress", "--json"])
            summary = json.loads(proc.stdout)
            runs.append({"wall_s": round(wall, 2), "seconds": summary["seconds"], "startup_s": summary["startup_s"],
                         "startup_share": summary["startup_share"], "steps": summary["steps"], "load_1m": round(load, 2)})
            torch_s.append(_timed([sys.executable, "-c", "import torch"])[0])
            floor_s.append(_timed([sys.executable, "-c", f"import torch, {QWEN35}"])[0])
    wall = statistics.median(r["wall_s"] for r in runs)
    share = statistics.median(r["startup_share"] for r in runs)
    loop = statistics.median(r["seconds"] - r["startup_s"] for r in runs)
    floor = statistics.median(floor_s)
    print(json.dumps({
        "benchmark": "train_startup",
        "preset": "tiny",
        "wall_s": round(wall, 2),
        "startup_s": round(statistics.median(r["startup_s"] for r in runs), 2),
        "startup_share": share,
        "loop_s": round(loop, 2),
        "import_torch_s": round(statistics.median(torch_s), 2),
        "import_torch_qwen35_s": round(floor, 2),
        "floor_share": round(floor / (floor + loop), 3),
        "runs": runs,
        "target": {"wall_s": TARGET_SECONDS, "startup_share": TARGET_SHARE},
        "meets_target": {"wall_s": wall <= TARGET_SECONDS, "startup_share": share <= TARGET_SHARE},
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }))


if __name__ == "__main__":
    main()
