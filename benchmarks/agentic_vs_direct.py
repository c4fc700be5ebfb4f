"""Agentic rollout time per episode against the direct rollout's, on the tiny ``miles train`` preset.

``miles train --preset tiny`` rolls out through the session service (``rollout.path =
"agentic"``: each episode opens a session, chats, takes its samples, closes it); the same run
with ``--set rollout.path="direct"`` sends the step's prompts to the engine as one batch. Both
runs are otherwise identical (same seed, prompts, samples per step, sampling settings, engine),
and they alternate (agentic, direct, direct, agentic, ...) so machine load hits both alike.

Per run, each step's ``time_rollout_*`` (from ``metrics.jsonl``) is divided by the step's
episodes (``prompts_per_step * samples_per_prompt``); the first step of each run (warm-up) is
left out. Headline: ``ratio`` = median agentic ms per episode / median direct ms per episode
over all runs of each. Target: ``ratio <= 1.5``.

Prints one JSON line. Usage::

    python benchmarks/agentic_vs_direct.py [--rounds 2] [--steps 8]
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

TARGET = 1.5


def _episodes_per_step() -> int:
    from miles_core.rl.config import load_config

    rollout = load_config("tiny").rollout
    return rollout.prompts_per_step * rollout.samples_per_prompt


EPISODES = _episodes_per_step()


def _run(path: str, steps: int, out: Path, extra: list[str]) -> list[float]:
    """One ``miles train --preset tiny`` run on ``path``; ms per episode of each step but the first."""
    sets = [f'rollout.path="{path}"', *extra, "run.stop_at_accuracy=1.0", "run.plot=false", "run.time_limit_s=900"]
    command = [sys.executable, "-m", "miles_core", "train", "--preset", "tiny", "--steps", str(steps), "--out", str(out),
               "--no-progress", "--json", *(arg for s in sets for arg in ("--set", s))]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"miles train ({path}) failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [next(v for k, v in r.items() if k.startswith("time_rollout_")) for r in records]
    return [t / EPISODES * 1000 for t in times[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="agentic/direct run pairs, alternating order")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the first is warm-up)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="another setting for both sides (repeatable)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 2:
        parser.error("--rounds must be >= 1 and --steps >= 2")
    load_before = os.getloadavg()
    per_path: dict[str, list[float]] = {"agentic": [], "direct": []}
    runs = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="miles-agentic-bench-") as tmp:
        for r in range(args.rounds):
            for path in ("agentic", "direct") if r % 2 == 0 else ("direct", "agentic"):
                ms = _run(path, args.steps, Path(tmp) / f"{path}-{r}", args.set)
                per_path[path] += ms
                runs.append({"path": path, "median_ms_per_episode": round(statistics.median(ms), 4)})
    agentic, direct = statistics.median(per_path["agentic"]), statistics.median(per_path["direct"])
    print(json.dumps({
        "benchmark": "agentic_vs_direct",
        "preset": "tiny",
        "episodes_per_step": EPISODES,
        "rounds": args.rounds,
        "steps": args.steps,
        "settings": args.set,
        "agentic_ms_per_episode": round(agentic, 4),
        "direct_ms_per_episode": round(direct, 4),
        "ratio": round(agentic / direct, 4),
        "runs": runs,
        "target": TARGET,
        "meets_target": agentic / direct <= TARGET,
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }))


if __name__ == "__main__":
    main()
