"""The built-in trackers. Descriptors only: each one's options model and sink (and its SDK) load
when a run or ``verify()`` asks for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import BaseModel

    from miles_core.rl.trackers.base import TrackerRun, TrackerSink


def _require(module: str) -> None:
    from miles_core.rl.registry import require_module

    require_module(module, "trackers")


@dataclass(frozen=True)
class JsonlTracker:
    """The run's own ``metrics.jsonl`` (always on)."""

    name: str = "jsonl"
    description: str = "metrics.jsonl in the run directory: one fsynced JSON line per step (always on)"

    @property
    def options(self) -> type[BaseModel]:
        from miles_core.rl.trackers.jsonl import JsonlOptions

        return JsonlOptions

    def open(self, run: TrackerRun, options: BaseModel) -> TrackerSink:
        from miles_core.rl.metrics import MetricsLog
        from miles_core.rl.trackers.jsonl import JsonlSink

        return JsonlSink(MetricsLog(run.out_dir / "metrics.jsonl"))

    def verify(self) -> None:
        from miles_core.rl.trackers.base import check_read_back

        check_read_back(self)


@dataclass(frozen=True)
class TensorBoardTracker:
    """TensorBoard event files written through ``torch.utils.tensorboard``."""

    name: str = "tensorboard"
    description: str = "TensorBoard event files through torch.utils.tensorboard, <out_dir>/tensorboard"

    @property
    def options(self) -> type[BaseModel]:
        from miles_core.rl.trackers.tensorboard_tracker import TensorBoardOptions

        return TensorBoardOptions

    def open(self, run: TrackerRun, options: BaseModel) -> TrackerSink:
        from pathlib import Path

        _require("tensorboard")  # torch.utils.tensorboard writes through it
        from miles_core.rl.trackers.tensorboard_tracker import TensorBoardOptions, TensorBoardSink

        assert isinstance(options, TensorBoardOptions)
        log_dir = Path(options.log_dir) if options.log_dir else run.out_dir / "tensorboard"
        return TensorBoardSink(log_dir, purge_step=run.first_step if run.resume else None)

    def verify(self) -> None:
        from miles_core.rl.trackers.base import check_read_back

        check_read_back(self)


@dataclass(frozen=True)
class WandbTracker:
    """Weights & Biases, offline unless its options say otherwise."""

    name: str = "wandb"
    description: str = "Weights & Biases; offline by default (<out_dir>/wandb, `wandb sync` uploads it)"

    @property
    def options(self) -> type[BaseModel]:
        from miles_core.rl.trackers.wandb_tracker import WandbOptions

        return WandbOptions

    def open(self, run: TrackerRun, options: BaseModel) -> TrackerSink:
        _require("wandb")
        from miles_core.rl.trackers.wandb_tracker import WandbOptions, WandbSink

        assert isinstance(options, WandbOptions)
        return WandbSink(run, options)

    def verify(self) -> None:
        from miles_core.rl.trackers.base import check_read_back

        check_read_back(self, self.options(mode="offline"))


@dataclass(frozen=True)
class MlflowTracker:
    """MLflow, into a local file store unless its ``tracking_uri`` option points elsewhere."""

    name: str = "mlflow"
    description: str = "MLflow; a local file store <out_dir>/mlruns by default"

    @property
    def options(self) -> type[BaseModel]:
        from miles_core.rl.trackers.mlflow_tracker import MlflowOptions

        return MlflowOptions

    def open(self, run: TrackerRun, options: BaseModel) -> TrackerSink:
        _require("mlflow")
        from miles_core.rl.trackers.mlflow_tracker import MlflowOptions, MlflowSink

        assert isinstance(options, MlflowOptions)
        return MlflowSink(run, options)

    def verify(self) -> None:
        from miles_core.rl.trackers.base import check_read_back

        check_read_back(self)


BUILTIN_TRACKERS = (JsonlTracker(), TensorBoardTracker(), WandbTracker(), MlflowTracker())
