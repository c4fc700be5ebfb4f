"""A run's open trackers: each step's record goes to every tracker ``run.trackers`` lists."""

from __future__ import annotations

from collections.abc import Sequence

from miles_core.rl.config import TrainConfig
from miles_core.rl.trackers.base import Record, Tracker, TrackerRun, TrackerSink, record_step


class Recorder:
    def __init__(self, sinks: Sequence[tuple[str, TrackerSink]]) -> None:
        self.sinks = list(sinks)

    @classmethod
    def open(cls, trackers: Sequence[Tracker], config: TrainConfig, *, resume: bool, first_step: int) -> Recorder:
        out_dir = config.run_dir
        run = TrackerRun(out_dir, out_dir.resolve().name, config.to_dict(), resume, first_step)
        sinks: list[tuple[str, TrackerSink]] = []
        try:
            for tracker in trackers:
                options = tracker.options.model_validate(config.run.tracker_options.get(tracker.name, {}))
                sinks.append((tracker.name, tracker.open(run, options)))
        except BaseException:
            cls(sinks).close()
            raise
        return cls(sinks)

    def log(self, record: Record) -> None:
        step = record_step(record)
        for _, sink in self.sinks:
            sink.log(step, record)

    def close(self) -> None:
        errors = []
        for name, sink in reversed(self.sinks):
            try:
                sink.close()
            except Exception as exc:  # close the others, then report
                exc.add_note(f"while closing tracker {name!r}")
                errors.append(exc)
        self.sinks = []
        if errors:
            raise errors[0]
