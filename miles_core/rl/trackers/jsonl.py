"""The ``jsonl`` tracker: ``<out_dir>/metrics.jsonl``, the run's own record (every value, every
step, fsynced before the step counts as done; resume, summary.json and plot.png read it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from miles_core.rl.metrics import MetricsLog
from miles_core.rl.trackers.base import Record, numeric


class JsonlOptions(BaseModel):
    """metrics.jsonl has no options."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class JsonlSink:
    def __init__(self, log: MetricsLog) -> None:
        self.metrics = log

    def log(self, step: int, record: Record) -> None:
        self.metrics.append({**record, "step": step})

    def close(self) -> None:
        """Every line is already fsynced."""

    def read_back(self) -> dict[int, dict[str, float]]:
        return {int(r["step"]): numeric(r) for r in self.metrics.read()}
