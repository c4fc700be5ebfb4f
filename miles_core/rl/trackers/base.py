"""The tracker protocol: a ``miles_trackers`` contribution, the sink it opens for a run, and the
probe its ``verify()`` runs.

A tracker declares its options as a pydantic model (``[run.tracker_options.<name>]`` is validated
against it when the config is built). Credentials are options that hold a *reference*
(``env:NAME`` or ``file:/path``, see :mod:`miles_core.sandbox.secrets`), resolved in ``open`` and
handed to the SDK only; the config a tracker records holds the reference, never the value.

Nothing here imports a tracker SDK, torch or pydantic (plugin discovery imports this module): a
descriptor loads its options model and its sink when asked for them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    from pydantic import BaseModel

#: one value of a metrics record (metrics.jsonl holds them all; other trackers the numbers)
MetricValue = float | int | str | bool | None | list[str]
Record = Mapping[str, MetricValue]


@dataclass(frozen=True)
class TrackerRun:
    """The run a tracker records."""

    out_dir: Path
    name: str  # the run directory's name, unless the tracker's options name it
    config: Mapping[str, object] = field(default_factory=dict)  # the resolved config (references only)
    resume: bool = False  # continuing a run: append to what the tracker recorded before
    first_step: int = 0  # the first step this process logs (on resume, the first recomputed one)


class TrackerSink(Protocol):
    """An open tracker of one run."""

    def log(self, step: int, record: Record) -> None:
        """Record one step's metrics (numbers; trackers that store text keep the rest too)."""
        ...

    def close(self) -> None:
        """Flush and finish the run (idempotent)."""
        ...

    def read_back(self) -> dict[int, dict[str, float]]:
        """What the tracker's own store holds now, ``step -> {metric: value}`` (after close)."""
        ...


@runtime_checkable
class Tracker(Protocol):
    """An experiment tracker contributed through ``miles_trackers``."""

    #: unique name; ``run.trackers`` lists it
    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    #: the pydantic model ``run.tracker_options.<name>`` is validated against
    @property
    def options(self) -> type[BaseModel]: ...

    def open(self, run: TrackerRun, options: BaseModel) -> TrackerSink:
        """Import the SDK and start recording ``run``."""
        ...

    def verify(self) -> None:
        """Raise unless records written through the tracker read back from its store
        (:func:`check_read_back` in a scratch directory)."""
        ...


def record_step(record: Record) -> int:
    """The record's ``step``: every record carries one, an integer (trackers index by it)."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"a metrics record needs an integer 'step', got {step!r}")
    return step


def numeric(record: Record) -> dict[str, float]:
    """The record's finite numbers (``step`` excluded: trackers index by it)."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


#: what the probe writes: two steps, an integer, a float a float32 store rounds, a gap (None)
PROBE_RECORDS: Sequence[dict[str, MetricValue]] = (
    {"step": 0, "reward_mean": 0.125, "loss": 1.0 / 3.0, "optimizer_steps": 1, "greedy_accuracy": 0.5,
     "weight_version": "step-1"},
    {"step": 1, "reward_mean": 0.75, "loss": -2.5e-3, "optimizer_steps": 1, "greedy_accuracy": None,
     "weight_version": "step-2"},
)
#: float32 stores (TensorBoard) keep 24 bits
READ_BACK_TOLERANCE = 1e-6


def check_read_back(tracker: Tracker, options: BaseModel | None = None,
                    records: Sequence[Record] = PROBE_RECORDS) -> dict[int, dict[str, float]]:
    """Write ``records`` through ``tracker`` into a scratch run directory, close it, and raise
    ``AssertionError`` unless its store gives every number back (relative tolerance
    :data:`READ_BACK_TOLERANCE`) at its step. Returns what was read back."""
    import tempfile  # here, not at module level: plugin discovery imports this module
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix=f"miles-tracker-{tracker.name}-") as tmp:
        run = TrackerRun(out_dir=Path(tmp), name="probe", config={"probe": True})
        sink = tracker.open(run, options if options is not None else tracker.options())
        try:
            for record in records:
                sink.log(record_step(record), record)
        finally:
            sink.close()
        stored = sink.read_back()
    for record in records:
        step = record_step(record)
        got = stored.get(step, {})
        for key, value in numeric(record).items():
            if key not in got or not math.isclose(got[key], value, rel_tol=READ_BACK_TOLERANCE, abs_tol=1e-9):
                raise AssertionError(
                    f"tracker {tracker.name!r}: step {step} {key} = {value!r} was written, "
                    f"its store reads back {got.get(key)!r}"
                )
    return stored


def secret_reference(value: str | None) -> str | None:
    """Validator of credential options: a reference (``env:NAME``, ``file:/path``), never a value."""
    if value is None:
        return None
    from miles_core.errors import ConfigError
    from miles_core.sandbox.secrets import SecretRef

    try:
        return str(SecretRef.parse(value, field="credential"))
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
