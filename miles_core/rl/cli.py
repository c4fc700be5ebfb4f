"""``miles train``: the main job. Heavy imports happen inside the command, never at import."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import click

from miles_core.cli import is_command_process
from miles_core.cli._output import quiet_libraries
from miles_core.errors import INTERRUPTED

_FLAG_SETTINGS = {
    "steps": "run.steps",
    "seed": "run.seed",
    "out": "run.out_dir",
    "checkpoint_every": "run.checkpoint_every",
    "orchestrator": "orchestrator.kind",
    "ray_address": "orchestrator.address",
    "backend": "trainer.backend",
    "rollout": "rollout.path",
    "algorithm": "algorithm.name",
    "task": "task.name",
    "model_path": "model.path",
}


@click.command(
    "train",
    epilog="Every setting of the config (see docs/train.md, or --print-config) can be set with "
    "--set SECTION.KEY=VALUE; flags are shorthands for the most common ones. Layers apply in "
    "order: --preset, --config, then flags and --set.",
)
@click.option("--preset", default=None, help="start from a named config: tiny (2-core CPU, under a minute) or small-gpu (one GPU).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="TOML file with [model], [task], [rollout], [reward], [algorithm], [trainer], [orchestrator], [run] tables.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="override one setting (repeatable); VALUE is parsed as TOML, else taken as a string.")
@click.option("--steps", type=int, default=None, help="training steps (run.steps).")
@click.option("--seed", type=int, default=None, help="seed of prompt order, sampling and initialisation (run.seed).")
@click.option("--out", default=None,
              help="run directory for metrics.jsonl, summary.json, plot.png, checkpoints/ (run.out_dir); without it "
              "each run gets a new directory under run.runs_dir, linked as <runs_dir>/latest.")
@click.option("--checkpoint-every", type=int, default=None, help="checkpoint each N steps; 0: only at the end (run.checkpoint_every).")
@click.option("--resume", is_flag=True,
              help="continue the run in --out (without --out: <runs_dir>/latest) from its newest intact checkpoint.")
@click.option("--orchestrator", default=None,
              help="where the engine, trainer and rollout workers run: inprocess, ray, or a plugin's (orchestrator.kind).")
@click.option("--ray-address", default=None, help="Ray cluster address; implies --orchestrator ray (orchestrator.address).")
@click.option("--backend", default=None, help="trainer backend: hf, megatron, or a plugin's (trainer.backend).")
@click.option("--rollout", default=None, help="rollout function: direct, agentic, or a plugin's (rollout.path).")
@click.option("--algorithm", default=None, help="RL algorithm: grpo, dr-grpo, gspo, or a plugin's (algorithm.name).")
@click.option("--task", default=None, help="task name from the miles_tasks hook (task.name).")
@click.option("--model-path", default=None, help="local Hugging Face model directory instead of a preset model (model.path).")
@click.option("--no-progress", is_flag=True, help="no live progress bar.")
@click.option("--print-config", is_flag=True, help="print the resolved, validated config as JSON and exit.")
@click.option("--json", "as_json", is_flag=True, help="print the run summary as one JSON document on stdout.")
def train(
    preset: str | None,
    config_file: str | None,
    overrides: tuple[str, ...],
    resume: bool,
    no_progress: bool,
    print_config: bool,
    as_json: bool,
    **flags: Any,
) -> None:
    """Train a policy with RL: rollouts -> rewards -> advantages and policy update -> weight sync, per step.

    The algorithm, rollout function, trainer backend, orchestrator and trackers are plugin
    contributions named in the config (`miles plugins list` shows what is installed).

    `miles train --preset tiny` runs the whole loop on a 2-core CPU: the tiny Qwen3.5 model learns
    to answer "n+1=", rollouts go through the session service, answers are checked in the local
    sandbox. Measured on an idle 2-core CPU (seeds 0-4): greedy accuracy 0.11 -> 1.00 in 16-26
    steps, 5-7.5 s including start-up.

    Each run without --out gets a new directory under run.runs_dir (runs/tiny/YYYYmmdd-HHMMSS
    for the tiny preset), linked as runs/tiny/latest; --resume continues latest. Ctrl-C stops
    after the step in flight with a checkpoint, summary.json and plot.png (exit status 130); a
    second Ctrl-C aborts at once.
    """
    started = _clock_origin()
    from miles_core.extras import require
    from miles_core.gc_pause import gc_paused
    from miles_core.plugins import get_plugin_manager

    quiet_libraries()

    layered: list[str | dict[str, Any]] = []
    for flag, value in flags.items():
        if value is not None:
            section, key = _FLAG_SETTINGS[flag].split(".")
            layered.append({section: {key: value}})
    if flags.get("ray_address") and flags.get("orchestrator") is None:
        layered.append({"orchestrator": {"kind": "ray"}})
    if no_progress:
        layered.append({"run": {"progress": False}})
    layered.extend(overrides)
    with gc_paused():  # pydantic and the config's models, the plugins: long-lived objects only
        from miles_core.rl.config import load_config

        config = load_config(preset, config_file, layered, pm=get_plugin_manager())
    if print_config:
        click.echo(json.dumps(config.to_dict(), indent=2))
        return
    if as_json:
        config = config.model_copy(update={"run": config.run.model_copy(update={"progress": False})})
    from miles_core.rl.preflight import choose_run_dir

    choose_run_dir(config, resume=resume)  # its errors come before torch is imported; the loop checks the rest
    require("train", "miles train")
    if config.trainer.backend == "megatron":
        require("megatron", "trainer.backend = 'megatron'")
    if config.orchestrator.kind == "ray":
        require("ray", "orchestrator.kind = 'ray'")

    from miles_core.rl.orchestrators import run_training

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if in_main else None
    try:
        # once the summary is written the run is over: a Ctrl-C only exits (no traceback from the
        # runtime's teardown or the lines that print the summary)
        result = run_training(config, get_plugin_manager(), resume=resume, started=started,
                              after_summary=_exit_interrupted if in_main else None)
    except KeyboardInterrupt:
        click.echo("aborted (Ctrl-C): the run stopped where it was; its last checkpoint, if any, is kept", err=True)
        sys.exit(INTERRUPTED)
    try:
        _report(result.summary(), as_json)
    finally:
        # the command's own process keeps the handler until it ends: Python's shutdown runs code of
        # its own (threading's, then atexit callbacks such as torch's), where a Ctrl-C would print a
        # KeyboardInterrupt traceback; a caller running the command in its process gets its own back
        if previous is not None and not is_command_process():
            signal.signal(signal.SIGINT, previous)


def _report(summary: dict[str, Any], as_json: bool) -> None:
    """Print the run's summary; exit 130 if a Ctrl-C stopped it."""
    if as_json:
        sys.stdout.write(json.dumps(summary, default=str) + "\n")
    else:
        verb = "interrupted" if summary["interrupted"] else "done"
        click.echo(
            f"{verb}: {summary['steps']} steps in {summary['seconds']:.1f}s; greedy accuracy "
            f"{_fmt(summary['initial_accuracy'])} -> {_fmt(summary['final_accuracy'])}; "
            f"max train-rollout log-prob mismatch {_fmt(summary['max_logprob_mismatch'], '.2e')}"
        )
        click.echo(f"metrics: {summary['metrics']}" + (f"  plot: {summary['plot']}" if summary["plot"] else ""))
        if summary["interrupted"]:
            click.echo("continue it with the same command and --resume", err=True)
    if summary["interrupted"]:
        sys.exit(INTERRUPTED)


def _exit_interrupted(signum: int, frame: object) -> None:
    """SIGINT once the run's summary is written: exit at once instead of a KeyboardInterrupt in the
    runtime's teardown (printed as "Exception ignored" where it lands in a finalizer) or a
    traceback from the lines that print the summary."""
    os.write(2, b"aborted (Ctrl-C)\n")
    os._exit(INTERRUPTED)


#: the longest Python may take from its process's start (exec) to importing miles: interpreter
#: start-up, site and .pth files (~0.05 s quiet; on a loaded machine more)
PYTHON_STARTUP_SLACK_S = 2.0
#: a process that imported miles this long before the run is not a fresh ``miles`` command
LONG_LIVED_S = 30.0


def clock_origin(now: float, imported_at: float, process_started: float | None) -> float:
    """The ``time.perf_counter()`` value the run's clock starts at, so that the progress bar and
    the summary count start-up (Python, imports) too: the process's start (``process_started``)
    if Python started with it, else when miles was first imported (``imported_at``).

    A process may have run something else before it exec'd Python: ``bash -c '... && miles train'``
    runs the last command in the shell's own process, whose start then predates Python's by all
    that ran before (the README's command, run a second time: 28 s of pip counted as the run's).
    A process that imported miles long before (a test runner or notebook invoking the command)
    starts the clock now: its age is not this run's.
    """
    if now - imported_at > LONG_LIVED_S:
        return now
    if process_started is not None and 0 <= imported_at - process_started < PYTHON_STARTUP_SLACK_S:
        return process_started
    return imported_at


def _process_started(now: float) -> float | None:
    """This process's start as a ``time.perf_counter()`` value (Linux: ``/proc/self/stat``)."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in ticks since boot
        return now - (time.clock_gettime(time.CLOCK_BOOTTIME) - start)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _clock_origin() -> float:
    from miles_core import IMPORTED_AT

    now = time.perf_counter()
    return clock_origin(now, IMPORTED_AT, _process_started(now))


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)

