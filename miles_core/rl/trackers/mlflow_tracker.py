"""The ``mlflow`` tracker: MLflow, by default into a local file store ``<out_dir>/mlruns``
(``mlflow ui --backend-store-uri <out_dir>/mlruns`` shows it).

``tracking_uri`` points elsewhere (a server, ``sqlite:///...``); a server's token is an option
holding a reference (``tracking_token = "env:MLFLOW_TRACKING_TOKEN"``), resolved here into the
variable the MLflow client reads. The config is logged as parameters (references only). The run
id is kept in ``<out_dir>/trackers.json`` so ``--resume`` continues the same MLflow run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles_core.rl.trackers.base import Record, TrackerRun, numeric, secret_reference
from miles_core.rl.trackers.state import load_state, save_state

#: MLflow keeps a parameter value to this many characters
PARAM_LIMIT = 6000


class MlflowOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tracking_uri: str | None = Field(None, description="MLflow tracking URI (default file:<out_dir>/mlruns)")
    experiment: str = Field("miles", description="experiment name")
    run_name: str | None = Field(None, description="run name (default: the run directory's name)")
    tracking_token: str | None = Field(None, description="reference to a tracking server token: env:NAME or file:/path")

    _reference = field_validator("tracking_token")(secret_reference)


class MlflowSink:
    def __init__(self, run: TrackerRun, options: MlflowOptions) -> None:
        uri = options.tracking_uri or (run.out_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3.x refuses its file store unless asked for it: a local store is what we want here
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if options.tracking_token is not None:
            from miles_core.sandbox.secrets import SecretRef

            os.environ["MLFLOW_TRACKING_TOKEN"] = SecretRef.parse(options.tracking_token).resolve().reveal()
        from mlflow.tracking import MlflowClient

        self.client: Any = MlflowClient(tracking_uri=uri)
        state = load_state(run.out_dir, "mlflow") if run.resume else {}
        if state:
            self.run_id = state["run_id"]
        else:
            experiment = self.client.get_experiment_by_name(options.experiment)
            experiment_id = (
                experiment.experiment_id if experiment is not None else self.client.create_experiment(options.experiment)
            )
            created = self.client.create_run(experiment_id, run_name=options.run_name or run.name)
            self.run_id = created.info.run_id
            self._log_params(run.config)
            save_state(run.out_dir, "mlflow", {"run_id": self.run_id})
        self._closed = False

    def _log_params(self, config: Mapping[str, object]) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)[:PARAM_LIMIT]) for key, value in _flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, step: int, record: Record) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in numeric(record).items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id)

    def read_back(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for key in self.client.get_run(self.run_id).data.metrics:
            for metric in self.client.get_metric_history(self.run_id, key):
                out.setdefault(int(metric.step), {})[key] = float(metric.value)
        return out


def _flatten(config: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out
