"""The RL loop, top to bottom.

    check        <- the run directory, the model and the device (:mod:`miles_core.rl.preflight`):
                    a bad setting fails here, before anything is written or built
    resolve      <- task, algorithm, rollout function, trainer backend, orchestrator, trackers:
                    each named in the config, looked up in the plugin registries and verified,
                    before anything is built
    build        <- the orchestrator places the engine, trainer and rollout (here or in Ray actors)
    for each step:
        prompts      <- the sampler (seeded permutation per epoch; its cursor is checkpointed)
        trajectories <- the rollout function (direct: batched token-in generation; agentic: the
                        session server; or a plugin's)
        rewards      <- the task's reward (in-process, or one batched check in a warm sandbox)
        advantages   <- the algorithm's estimator (GRPO: group normalisation)
        update       <- packed rows, the algorithm's policy loss, optimizer step (in the trainer)
        sync         <- the trainer's weights into the engine (new weight version)
        record       <- one record to every tracker (metrics.jsonl first); a checkpoint every N steps

Greedy evaluation (every prompt, temperature 0) runs at the start of a step, on the policy that
is about to produce that step's rollouts, and once more when the run ends. A first Ctrl-C ends
the run after the step in flight like any stop (checkpoint, plot, summary with ``interrupted``).
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError
from miles_core.fileio import write_json_atomic
from miles_core.gc_pause import gc_paused
from miles_core.hardware.activation import activate
from miles_core.plugins import MilesPluginManager
from miles_core.rl import preflight, registry
from miles_core.rl.algorithms.base import Algorithm
from miles_core.rl.algorithms.batch import TrainDocument
from miles_core.rl.checkpoint import (
    LoopState,
    check_resumable,
    latest_valid,
    read_state,
    restore_rng,
    save_checkpoint,
)
from miles_core.rl.config import TrainConfig
from miles_core.rl.metrics import MetricsLog, Progress
from miles_core.rl.plot_worker import PlotWorker
from miles_core.rl.rollout.types import Trajectory
from miles_core.rl.runtime import Parts, Runtime, resolve_parts
from miles_core.rl.tasks import Prompt
from miles_core.rl.trackers.base import MetricValue, Tracker
from miles_core.rl.trackers.recorder import Recorder

Record = dict[str, MetricValue]
Build = Callable[[TrainConfig, MilesPluginManager, Parts], Runtime]


class PromptSampler:
    """``per_step`` prompts at a time from a fresh seeded permutation each epoch."""

    def __init__(self, prompts: Sequence[Prompt], per_step: int, seed: int) -> None:
        self.prompts = list(prompts)
        self.per_step = per_step
        self.seed = seed
        self.epoch, self.offset = 0, 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next(self) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < self.per_step:
            order = self._order(self.epoch)
            take = order[self.offset : self.offset + self.per_step - len(out)]
            out += [self.prompts[i] for i in take]
            self.offset += len(take)
            if self.offset >= len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    @property
    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def restore(self, cursor: dict[str, int]) -> None:
        self.epoch, self.offset = cursor["epoch"], cursor["offset"]


def _numbers(records: Sequence[Record], key: str) -> list[float]:
    """``key``'s value in each record that holds a number there."""
    return [v for r in records if isinstance(v := r.get(key), float | int)]


@dataclass
class RunResult:
    out_dir: Path
    steps_done: int
    initial_accuracy: float | None
    final_accuracy: float | None
    stopped_early: bool
    seconds: float
    records: list[Record]
    report: dict[str, object]
    hardware: dict[str, object]  # the backend that ran (ActiveHardware.summary)
    #: seconds from the run's clock origin (the CLI: the process's start) to its first step
    startup_s: float = 0.0
    #: a first Ctrl-C stopped the run after the step in flight (exit status 130)
    interrupted: bool = False

    def summary(self) -> dict[str, object]:
        last = self.records[-1] if self.records else {}
        return {
            "out_dir": str(self.out_dir),
            "steps": self.steps_done,
            "initial_accuracy": self.initial_accuracy,
            "final_accuracy": self.final_accuracy,
            "stopped_early": self.stopped_early,
            "interrupted": self.interrupted,
            "seconds": round(self.seconds, 2),
            "startup_s": round(self.startup_s, 2),
            "startup_share": round(self.startup_s / self.seconds, 3) if self.seconds > 0 else None,
            "last": last,
            "max_logprob_mismatch": max(_numbers(self.records, "logprob_mismatch_max"), default=None),
            "mean_logprob_mismatch": (sum(means) / len(means) if (means := _numbers(self.records, "logprob_mismatch_mean"))
                                      else None),
            "metrics": str(self.out_dir / "metrics.jsonl"),
            "summary": str(self.out_dir / "summary.json"),
            "plot": str(self.out_dir / "plot.png") if (self.out_dir / "plot.png").exists() else None,
            "report": self.report,
            "hardware": self.hardware,
        }


class Timer:
    def __init__(self) -> None:
        self.split: dict[str, float] = {}

    def time(self, key: str) -> _Span:
        return _Span(self, key)


class _Span:
    def __init__(self, timer: Timer, key: str) -> None:
        self.timer, self.key = timer, key

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.started
        self.timer.split[self.key] = self.timer.split.get(self.key, 0.0) + elapsed


#: what ``signal.signal`` takes as a handler
SignalHandler = Callable[[int, Any], None]


class StopRequest:
    """Ctrl-C while the loop runs (main thread only): the first SIGINT asks the loop to stop after
    the step in flight -- the run then ends as at any stop, with a checkpoint of that step, the
    plot and ``summary.json`` (``interrupted: true``); a second raises KeyboardInterrupt.

    While the runtime closes (:meth:`closing`), and from the summary's write (:meth:`summarised`)
    on, a Ctrl-C is held until the close has finished and is acted on then; only another one
    interrupts the close itself. Acting on it means raising KeyboardInterrupt, or, once the summary
    is written, calling ``after_summary`` when the caller gave one: the ``miles train`` command's
    exits at once (the run is over and on disk). ``after_summary`` also replaces the caller's
    handler when this one leaves: a Ctrl-C while the run's objects are torn down must not raise
    where Python can only print it ("Exception ignored in ... KeyboardInterrupt")."""

    def __init__(self, after_summary: SignalHandler | None = None) -> None:
        self.requested = False
        self.on_request: Callable[[], None] | None = None
        self._after_summary = after_summary
        self._previous: Any = None
        self._closing = False
        self._summarised = False
        self._deferred = False

    def __enter__(self) -> StopRequest:
        in_main = threading.current_thread() is threading.main_thread()
        if in_main and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # nohup/background jobs ignore it
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if (self._closing or self._summarised) and not self._deferred:
            self._deferred = True
            return
        if self.requested or self._closing or self._summarised:
            self._interrupt(signum, frame)
            return
        self.requested = True
        if self.on_request is not None:
            self.on_request()

    def summarised(self) -> None:
        """The run's summary is written: from now on a Ctrl-C is held, then handled as above."""
        self._summarised = True

    def _interrupt(self, signum: int, frame: object) -> None:
        """Act on a Ctrl-C now: after the summary the caller's ``after_summary`` if it gave one,
        else KeyboardInterrupt (raised in place of a held one)."""
        if self._summarised and self._after_summary is not None:
            self._after_summary(signum, frame)
        else:
            self._deferred = False
            raise KeyboardInterrupt

    def _act_on_deferred(self) -> None:
        if self._deferred:
            self._deferred = False
            self._interrupt(signal.SIGINT, None)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._previous is None:
            return
        after = self._after_summary if self._summarised else None
        signal.signal(signal.SIGINT, after or self._previous)
        if exc_type is None:
            self._act_on_deferred()  # one that came after the close

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """Close the runtime: a KeyboardInterrupt raised inside a close cuts it short at any line
        -- an event loop left half closed, the closers after it skipped (their native threads
        then abort the interpreter at exit: "terminate called without an active exception"), an
        "Exception ignored" from a weakref callback -- so a Ctrl-C now is acted on after it. Not
        when the close ends by an exception: that one goes on."""
        self._closing = True
        try:
            yield
        except BaseException:
            self._deferred = False
            raise
        finally:
            self._closing = False
        self._act_on_deferred()


def evaluate(runtime: Runtime, prompts: Sequence[Prompt]) -> float:
    """Share of prompts whose greedy completion earns reward 1."""
    trajectories = runtime.evaluator.run(prompts, step=0, greedy=True)
    rewards = runtime.rewards.score([t.reward_input() for t in trajectories])
    return sum(1 for r in rewards if r >= 1.0) / len(rewards)


def make_documents(algorithm: Algorithm, trajectories: Sequence[Trajectory], rewards: Sequence[float],
                   config: TrainConfig) -> list[TrainDocument]:
    """One training document per trajectory, carrying the algorithm's advantage for it."""
    import torch

    group_size = config.rollout.samples_per_prompt
    advantages = algorithm.advantages(torch.tensor(rewards), group_size, config.algorithm)
    if tuple(advantages.shape) != (len(trajectories),):
        raise RuntimeError(
            f"algorithm {algorithm.name!r} returned advantages of shape {tuple(advantages.shape)} "
            f"for {len(trajectories)} samples"
        )
    return [t.document(float(a)) for t, a in zip(trajectories, advantages.tolist(), strict=True)]


def train(
    config: TrainConfig,
    pm: MilesPluginManager,
    *,
    resume: bool = False,
    build: Build | None = None,
    started: float | None = None,
    after_summary: SignalHandler | None = None,
) -> RunResult:
    """Run (or resume) training; ``build`` assembles the runtime (default: ``orchestrator.kind``'s).

    ``started`` is the ``time.perf_counter()`` the run's clock counts from (the CLI passes the
    process's start, so the progress bar and the summary include start-up); default: now.
    ``after_summary``: the SIGINT handler from the summary's write on (see :class:`StopRequest`);
    default: a Ctrl-C then raises KeyboardInterrupt once the runtime is closed.
    """
    started = time.perf_counter() if started is None else started
    # matplotlib is imported by a child process on the core start-up and training leave idle
    plotter = PlotWorker() if config.run.plot else None
    try:
        return _train(config, pm, resume, build, started, plotter, after_summary)
    finally:
        if plotter is not None:
            plotter.close()  # a run that ended before its plot lets the worker go


def _train(config: TrainConfig, pm: MilesPluginManager, resume: bool, build: Build | None, started: float,
           plotter: PlotWorker | None, after_summary: SignalHandler | None) -> RunResult:
    # start-up (verification, models, engine, sandbox) builds what the run keeps; the in-process
    # build collects once and freezes it (runtime.freeze_startup_heap) before collection resumes
    with gc_paused():
        run_dir = preflight.check(config, pm, resume=resume)
        checkpoint = _resume_point(run_dir.path, config) if resume else None
        out_dir = run_dir.create()
        config = config.model_copy(update={"run": config.run.model_copy(update={"out_dir": str(out_dir)})})
        try:
            metrics = MetricsLog(out_dir / "metrics.jsonl")
            parts = resolve_parts(config, pm)
            trackers = registry.trackers(pm, config)
            if build is None:
                build = registry.orchestrator(pm, config).build
            runtime = build(config, pm, parts)
        except BaseException:
            run_dir.discard()
            raise
    failed = True
    with StopRequest(after_summary) as stop:
        try:
            result = _run(config, runtime, metrics, trackers, checkpoint, started, stop, plotter)
            failed = False
            return result
        finally:
            with stop.closing():
                try:
                    runtime.close()
                finally:
                    if failed and not metrics.read():  # a run that failed before its first step leaves nothing
                        run_dir.discard()


def _checkpoint(config: TrainConfig, runtime: Runtime, sampler: PromptSampler, step: int, version: str) -> int:
    """Save the state after ``step``; returns ``step``."""
    state = LoopState(step=step, cursor=sampler.cursor, weight_version=version, config=config.to_dict())
    save_checkpoint(config.run_dir, runtime.trainer, state, config.run.keep_checkpoints)
    return step


def _resume_point(out_dir: Path, config: TrainConfig) -> Path | None:
    """The checkpoint to resume from, validated before anything is built."""
    checkpoint = latest_valid(out_dir)
    if checkpoint is None:
        if (out_dir / "metrics.jsonl").exists():
            raise ConfigError(f"--resume: {out_dir} has metrics but no complete checkpoint to resume from")
        return None
    check_resumable(read_state(checkpoint).config, config.to_dict(), TrainConfig().to_dict())
    return checkpoint


def _run(config: TrainConfig, runtime: Runtime, metrics: MetricsLog, trackers: Sequence[Tracker],
         checkpoint: Path | None, started: float, stop: StopRequest, plotter: PlotWorker | None) -> RunResult:
    task, algorithm, rollout_cfg, run_cfg = runtime.parts.task, runtime.parts.algorithm, config.rollout, config.run
    prompts = list(task.prompts)
    sampler = PromptSampler(prompts, rollout_cfg.prompts_per_step, run_cfg.seed)
    first_step, version = 0, runtime.engine.weight_version
    if checkpoint is not None:
        state = read_state(checkpoint)
        runtime.trainer.load(checkpoint)
        restore_rng(checkpoint)
        sampler.restore(state.cursor)
        version = runtime.sync_weights(state.weight_version)
        metrics.truncate_after(state.step)
        first_step = state.step + 1
    records = metrics.read()
    initial_accuracy = next((r["greedy_accuracy"] for r in records if r.get("greedy_accuracy") is not None), None)
    recorder = Recorder.open(trackers, config, resume=checkpoint is not None, first_step=first_step)
    progress = Progress(run_cfg.steps, first_step, run_cfg.progress, started)
    stop.on_request = progress.stopping
    accuracy, stopped_early, step = None, False, first_step - 1
    saved_step = first_step - 1  # the step the newest checkpoint holds
    loop_started = time.perf_counter()
    try:
        for step in range(first_step, run_cfg.steps):
            timer = Timer()
            step_started = time.perf_counter()

            accuracy = None
            if task.has_accuracy and run_cfg.eval_every and step % run_cfg.eval_every == 0:
                with timer.time("eval"):
                    accuracy = evaluate(runtime, prompts)
                if initial_accuracy is None:
                    initial_accuracy = accuracy
                if run_cfg.stop_at_accuracy is not None and accuracy >= run_cfg.stop_at_accuracy:
                    stopped_early = True
                    step -= 1
                    break

            batch = [p for p in sampler.next() for _ in range(rollout_cfg.samples_per_prompt)]
            with timer.time(f"rollout_{runtime.rollout.label}"):
                trajectories = runtime.rollout.run(batch, step)
            with timer.time(f"reward_{runtime.rewards.where}"):
                rewards = runtime.rewards.score([t.reward_input() for t in trajectories])
            docs = make_documents(algorithm, trajectories, rewards, config)
            with timer.time("train"):
                stats = runtime.trainer.train(docs)
            with timer.time("sync"):
                version = runtime.sync_weights(f"step-{step + 1}")

            step_time = time.perf_counter() - step_started
            generated = sum(t.generated_tokens for t in trajectories)
            rollout_time = timer.split[f"rollout_{runtime.rollout.label}"]
            record: Record = {
                "step": step,
                "weight_version": version,
                "reward_mean": sum(rewards) / len(rewards),
                "greedy_accuracy": accuracy,
                "response_length_mean": generated / len(trajectories),
                "turns_mean": sum(t.turns for t in trajectories) / len(trajectories),
                "rollout_weight_versions": sorted({t.weight_version for t in trajectories}),
                **stats,
                **{f"time_{k}": round(v, 4) for k, v in timer.split.items()},
                "time_step": round(step_time, 4),
                "tokens_per_s": generated / step_time,
                "rollout_tokens_per_s": generated / rollout_time if rollout_time else 0.0,
                "train_tokens_per_s": stats["train_tokens"] / timer.split["train"],
                "elapsed_s": round(time.perf_counter() - started, 3),
            }
            recorder.log(record)
            progress.update(record)
            if run_cfg.checkpoint_every and (step + 1) % run_cfg.checkpoint_every == 0:
                saved_step = _checkpoint(config, runtime, sampler, step, version)
            if run_cfg.time_limit_s is not None and time.perf_counter() - loop_started > run_cfg.time_limit_s:
                break
            if stop.requested:
                break
        if step > saved_step:  # the last step, the time limit or an early stop: keep the final policy
            _checkpoint(config, runtime, sampler, step, version)
        if stop.requested:
            accuracy = None  # not measured on the final policy: the stop skips the final evaluation
        elif not stopped_early and task.has_accuracy and run_cfg.eval_every:
            accuracy = evaluate(runtime, prompts)
    finally:
        progress.close()
        recorder.close()
    records = metrics.read()
    if plotter is not None and records:
        final = (step + 1, accuracy) if accuracy is not None else None
        plotter.render(records, config.run_dir / "plot.png", f"miles train: {config.task.name}", final)
    result = RunResult(
        out_dir=config.run_dir,
        steps_done=step + 1,
        initial_accuracy=initial_accuracy,
        final_accuracy=accuracy,
        stopped_early=stopped_early,
        interrupted=stop.requested,
        seconds=time.perf_counter() - started,
        startup_s=loop_started - started,
        records=records,
        report=dict(runtime.trainer.report),
        hardware=activate().summary(),
    )
    write_json_atomic(config.run_dir / "summary.json", result.summary())
    stop.summarised()
    return result
