"""CLI start-up cost: `miles plugins list --json` vs `python -c "import click, pluggy"`.

Prints one JSON line: both medians (seconds) and their ratio (target <= 2.0), measured in the same
run, interleaved so machine noise hits both equally. It also reports which heavy modules the
command imported (must be none) and the 1-minute load average before and after.

    python benchmarks/cli_startup.py [--runs 21]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("torch", "transformers", "ray", "megatron", "e2b")


#: Both commands run with Python's bytecode cache on, as on a normal installation (some CI
#: environments export PYTHONDONTWRITEBYTECODE=1, which would recompile every miles module of an
#: editable install on each start while the baseline's packages ship compiled).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    return time.perf_counter() - started


def heavy_imports() -> list[str]:
    probe = (
        "import sys\nfrom miles_core.cli import main\n"
        "try:\n    main(['plugins', 'list', '--json'])\nexcept SystemExit:\n    pass\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=ENV)
    return [m for m in done.stderr.strip().splitlines()[-1].split(",") if m] if done.stderr.strip() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="timed runs of each command (after one warm-up)")
    args = parser.parse_args()

    miles = str(Path(sys.executable).with_name("miles"))
    if not os.path.exists(miles):
        sys.exit(f"no `miles` console script next to {sys.executable}; install the repository first")
    load_before = os.getloadavg()[0]
    command = [miles, "plugins", "list", "--json"]
    baseline = [sys.executable, "-c", "import click, pluggy"]
    wall(command), wall(baseline)  # warm the page cache and bytecode
    ours, base = [], []
    for _ in range(args.runs):
        ours.append(wall(command))
        base.append(wall(baseline))
    plugins = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)[
        "plugins"
    ]
    result = {
        "benchmark": "cli_startup",
        "runs": args.runs,
        "plugins_list_median_s": round(statistics.median(ours), 4),
        "import_click_pluggy_median_s": round(statistics.median(base), 4),
        "ratio": round(statistics.median(ours) / statistics.median(base), 3),
        "target_ratio": 2.0,
        "plugins": len(plugins),
        "heavy_modules_imported": heavy_imports(),
        "bytecode_cache": True,
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
