"""Where an episode's CPU goes, agentic against direct, on the tiny preset's rollouts (diagnostic).

One process builds the ``miles train --preset tiny`` runtime (in-process orchestrator, agentic
rollout) and a direct rollout over the same engine, then rolls out ``--steps`` steps of the
preset's batches (144 episodes), each step on both paths, alternating which goes first. Per step
and path: the wall time and each thread's CPU time (``pthread_getcpuclockid``), per episode; the
first ``--warmup`` steps are left out. Unlike ``agentic_vs_direct.py`` (wall time inside whole
training runs, which the machine's other load moves by 2-3x), the per-thread CPU clocks show
what each path costs its threads, and the wall time here compares the paths step by step.

Prints one JSON line: medians in us per episode, and ``wall_ratio`` (median agentic wall /
median direct wall) and ``cpu_ratio`` (the same over the sum of the threads' CPU). Usage::

    python benchmarks/agentic_cpu_split.py [--steps 60] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time


def _clocks() -> dict[str, float]:
    return {t.name: time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            for t in threading.enumerate() if t.ident is not None and t.is_alive()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    from miles_core.plugins import get_plugin_manager
    from miles_core.rl import registry
    from miles_core.rl.config import load_config
    from miles_core.rl.loop import PromptSampler
    from miles_core.rl.rollout.direct import DirectRollout
    from miles_core.rl.runtime import resolve_parts

    load_before = os.getloadavg()
    pm = get_plugin_manager()
    with tempfile.TemporaryDirectory(prefix="miles-cpu-split-") as tmp:
        config = load_config("tiny", overrides=[{"run": {"out_dir": f"{tmp}/run", "plot": False},
                                                 "rollout": {"path": "agentic"}}])
        parts = resolve_parts(config, pm)
        runtime = registry.orchestrator(pm, config).build(config, pm, parts)
        try:
            # the direct path over the same engine, with the run's tokenizer (the evaluator's)
            direct = DirectRollout(runtime.engine, runtime.evaluator.tokenizer, config.rollout, config.run.seed)
            paths = {"agentic": runtime.rollout, "direct": direct}
            sampler = PromptSampler(list(parts.task.prompts), config.rollout.prompts_per_step, config.run.seed)
            samples: dict[str, dict[str, list[float]]] = {"agentic": {}, "direct": {}}
            for step in range(args.steps):
                batch = [p for p in sampler.next() for _ in range(config.rollout.samples_per_prompt)]
                for name in ("agentic", "direct") if step % 2 else ("direct", "agentic"):
                    before = _clocks()
                    started = time.perf_counter()
                    paths[name].run(batch, step)
                    wall = time.perf_counter() - started
                    after = _clocks()
                    if step < args.warmup:
                        continue
                    per = samples[name]
                    per.setdefault("wall", []).append(wall / len(batch) * 1e6)
                    total = 0.0
                    for thread, clock in after.items():
                        if thread not in before:
                            continue
                        us = (clock - before[thread]) / len(batch) * 1e6
                        if thread.startswith("miles-engine"):
                            thread = "engine"
                        per.setdefault(thread, []).append(us)
                        total += us
                    per.setdefault("cpu_total", []).append(total)
        finally:
            runtime.close()
    medians = {name: {k: round(statistics.median(v), 1) for k, v in per.items() if statistics.median(v) >= 0.1}
               for name, per in samples.items()}
    print(json.dumps({
        "benchmark": "agentic_cpu_split",
        "preset": "tiny",
        "episodes_per_step": config.rollout.prompts_per_step * config.rollout.samples_per_prompt,
        "steps": args.steps - args.warmup,
        "us_per_episode": medians,
        "wall_ratio": round(medians["agentic"]["wall"] / medians["direct"]["wall"], 3),
        "cpu_ratio": round(medians["agentic"]["cpu_total"] / medians["direct"]["cpu_total"], 3),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }))


if __name__ == "__main__":
    main()
