"""Per-step metrics: an append-only JSONL file, progress on stderr, and a plot at the end.

Each step's record is one line, flushed and fsynced before the step counts as done, so a killed
run loses at most the step in flight. On resume the file is cut back to the checkpoint's step
(the steps after it are recomputed, identically with fixed seeds).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def is_timing(key: str) -> bool:
    """Metrics that depend on wall time, hence differ between otherwise identical runs."""
    return key.startswith("time_") or key.endswith("_per_s") or key == "elapsed_s"


def deterministic_view(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record without its timing fields (what two runs with the same seeds must agree on)."""
    return {k: v for k, v in record.items() if not is_timing(k)}


class MetricsLog:
    """``metrics.jsonl`` in the run directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        records = []
        with self.path.open() as f:
            for line in f:
                if line.endswith("\n"):  # a line cut short by a kill is not a record
                    records.append(json.loads(line))
        return records

    def truncate_after(self, step: int) -> None:
        """Keep the records of steps ``<= step`` (used on resume); rewritten atomically."""
        kept = [r for r in self.read() if r["step"] <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as f:
            for record in kept:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)

    def append(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def format_elapsed(seconds: float) -> str:
    """``h:mm:ss``."""
    whole = max(0, int(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def step_summary(record: Mapping[str, Any]) -> str:
    """``reward 0.125 | acc 0.11 | mismatch 1.2e-06 | 2400 tok/s`` for one step's record."""
    parts = [f"reward {record['reward_mean']:.3f}"]
    if record.get("greedy_accuracy") is not None:
        parts.append(f"acc {record['greedy_accuracy']:.2f}")
    parts.append(f"mismatch {record['logprob_mismatch_max']:.1e}")
    parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


class Progress:
    """Progress on stderr: a live bar on a terminal, one line per step otherwise.

    The clock counts from ``started`` (a ``time.perf_counter()`` value; the CLI passes the
    process's start, so start-up is included). :meth:`stopping` may be called from a signal
    handler: it only sets a flag (the bar shows it) or writes one line with ``os.write``.
    """

    def __init__(
        self, total: int, start: int, enabled: bool, started: float | None = None, console: Any = None
    ) -> None:
        self.enabled = enabled
        self.total = total
        self.started = time.perf_counter() if started is None else started
        self.stop_requested = False
        if not enabled:
            return
        from rich.console import Console

        self._console = console if console is not None else Console(stderr=True)
        self.live = self._console.is_terminal
        if self.live:
            self._start_bar(start)

    def _start_bar(self, start: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, TextColumn
        from rich.progress import Progress as Bar
        from rich.table import Column
        from rich.text import Text

        progress = self

        class Elapsed(ProgressColumn):
            """Wall time since the run's clock started; never truncated."""

            def __init__(self) -> None:
                super().__init__(table_column=Column(no_wrap=True, min_width=7))

            def render(self, task: Any) -> Text:
                return Text(format_elapsed(time.perf_counter() - progress.started), style="progress.elapsed")

        class Live(TextColumn):
            def render(self, task: Any) -> Text:
                if progress.stop_requested:
                    return Text("stopping after this step (Ctrl-C again aborts)", style="bold yellow")
                return super().render(task)

        self._bar = Bar(
            TextColumn("[bold]train", table_column=Column(no_wrap=True)),
            BarColumn(bar_width=12),
            MofNCompleteColumn(table_column=Column(no_wrap=True)),
            Elapsed(),
            # the only column that gives way on a narrow terminal
            Live("{task.fields[live]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
            console=self._console,
            transient=False,
            expand=True,  # the ratio column takes what is left: the others keep their widths
        )
        self._task = self._bar.add_task("train", total=self.total, completed=start, live="starting")
        self._bar.start()

    def update(self, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        live = step_summary(record)
        if self.live:
            self._bar.update(self._task, completed=record["step"] + 1, live=live)
        else:
            elapsed = format_elapsed(time.perf_counter() - self.started)
            self._console.print(f"train {record['step'] + 1}/{self.total} {elapsed} {live}", highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        """A line above the bar (or on its own without a terminal)."""
        if self.enabled:
            self._console.print(text, highlight=False, soft_wrap=True)

    def stopping(self) -> None:
        """A stop was requested (safe to call from a signal handler)."""
        self.stop_requested = True
        if not (self.enabled and self.live):
            os.write(2, b"interrupted: finishing the step in flight, then checkpoint, summary and plot "
                        b"(Ctrl-C again aborts)\n")

    def close(self) -> None:
        if self.enabled and self.live:
            self._bar.stop()


PLOTTED = (
    ("reward_mean", "reward"),
    ("greedy_accuracy", "greedy accuracy"),
    ("response_length_mean", "response length"),
    ("logprob_mismatch_max", "train-rollout |Δ log p| max"),
    ("entropy", "entropy"),
    ("grad_norm", "grad norm"),
)


def warm_plotting() -> None:
    """Import what :func:`plot_run` uses and render a tiny figure once (fonts loaded, caches
    filled), so that the next plot costs only its own drawing."""
    import io

    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], marker=".")
    ax.bar([0, 1], [1, 2], label="x")
    ax.legend(fontsize=7)
    ax.set_title("warm-up")
    fig.savefig(io.BytesIO(), format="png", dpi=20)


def plot_run(
    records: Iterable[Mapping[str, Any]], path: Path, title: str, final_accuracy: tuple[int, float] | None = None
) -> Path:
    """A PNG with one panel per headline metric plus the time split (matplotlib, Agg).

    ``final_accuracy`` is ``(steps_done, accuracy)`` of the evaluation after the last step (it
    belongs to no step's record), drawn on the accuracy panel.
    """
    # a bare Figure renders with Agg and needs no pyplot (its import and global state cost ~0.4 s);
    # fixed margins instead of tight_layout, which measures every text artist first (~0.4 s)
    from matplotlib.figure import Figure

    records = list(records)
    fig = Figure(figsize=(16, 7))
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.08, top=0.9, wspace=0.25, hspace=0.4)
    axes = fig.subplots(2, 4)
    for ax, (key, label) in zip(axes.flat, PLOTTED):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if key == "greedy_accuracy" and final_accuracy is not None:
            points.append(final_accuracy)
        if points:
            ax.plot(*zip(*points), marker="." if len(points) < 50 else None)
        ax.set_title(label)
        ax.set_xlabel("step")
    ax = axes.flat[len(PLOTTED)]
    time_keys = sorted({k for r in records for k in r if k.startswith("time_") and k != "time_step"})
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    for key in time_keys:
        values = [r.get(key, 0.0) for r in records]
        ax.bar(steps, values, bottom=bottom, label=key.removeprefix("time_"), width=1.0)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_title("time split (s)")
    ax.legend(fontsize=7)
    ax = axes.flat[len(PLOTTED) + 1]
    ax.plot(steps, [r.get("tokens_per_s", 0.0) for r in records])
    ax.set_title("tokens/s")
    fig.suptitle(title)
    fig.savefig(path, dpi=80)
    return path
