"""Per-step metrics: an append-only JSONL file, a live progress bar, and a plot at the end.

Each step's record is one line, flushed and fsynced before the step counts as done, so a killed
run loses at most the step in flight. On resume the file is cut back to the checkpoint's step
(the steps after it are recomputed, identically with fixed seeds).
"""

from __future__ import annotations

import json
import os
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


class Progress:
    """A rich progress bar on stderr with the latest reward, accuracy, mismatch and speed."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[live]}"),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._bar.add_task("train", total=total, completed=start, live="starting")
        self._bar.start()

    def update(self, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        parts = [f"reward {record['reward_mean']:.3f}"]
        if record.get("greedy_accuracy") is not None:
            parts.append(f"acc {record['greedy_accuracy']:.2f}")
        parts.append(f"mismatch {record['logprob_mismatch_max']:.1e}")
        parts.append(f"{record['tokens_per_s']:.0f} tok/s")
        self._bar.update(self._task, completed=record["step"] + 1, live=" | ".join(parts))

    def close(self) -> None:
        if self.enabled:
            self._bar.stop()


PLOTTED = (
    ("reward_mean", "reward"),
    ("greedy_accuracy", "greedy accuracy"),
    ("response_length_mean", "response length"),
    ("logprob_mismatch_max", "train-rollout |Δ log p| max"),
    ("entropy", "entropy"),
    ("grad_norm", "grad norm"),
)


def plot_run(
    records: Iterable[Mapping[str, Any]], path: Path, title: str, final_accuracy: tuple[int, float] | None = None
) -> Path:
    """A PNG with one panel per headline metric plus the time split (matplotlib, Agg).

    ``final_accuracy`` is ``(steps_done, accuracy)`` of the evaluation after the last step (it
    belongs to no step's record), drawn on the accuracy panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
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
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
