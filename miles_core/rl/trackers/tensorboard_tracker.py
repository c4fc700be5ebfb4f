"""The ``tensorboard`` tracker: scalars through ``torch.utils.tensorboard`` (needs the
``tensorboard`` package: ``pip install 'miles[trackers]'``), event files under
``<out_dir>/tensorboard`` unless ``log_dir`` says otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miles_core.rl.trackers.base import Record, numeric


class TensorBoardOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    log_dir: str | None = Field(None, description="event-file directory (default <out_dir>/tensorboard)")


class TensorBoardSink:
    def __init__(self, log_dir: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        # on resume, events of steps at or after the first recomputed one are discarded by readers
        self.writer: Any = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, record: Record) -> None:
        for key, value in numeric(record).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def read_back(self) -> dict[int, dict[str, float]]:
        return read_event_files(self.log_dir)


def read_event_files(log_dir: Path) -> dict[int, dict[str, float]]:
    """Every scalar in the event files of ``log_dir``, parsed by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in accumulator.Tags()["scalars"]:
        for event in accumulator.Scalars(tag):
            out.setdefault(int(event.step), {})[tag] = float(event.value)
    return out
