"""Conformance kit for tracker authors (``miles_trackers``)::

    from miles_core.testing.trackers import assert_tracker_conforms

    def test_my_tracker_conforms():
        assert_tracker_conforms(MyTracker())

Checked: the protocol's attributes; the options model accepts no options (every option has a
default) and refuses an unknown one; records written through the tracker read back from its own
store (:func:`miles_core.rl.trackers.base.check_read_back`); ``close()`` may be called twice; a
run resumed in the same directory adds its steps to what the tracker recorded before; and
``verify()`` passes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from pydantic import BaseModel, ValidationError

from miles_core.rl.trackers.base import PROBE_RECORDS, Tracker, TrackerRun, check_read_back


def assert_tracker_conforms(tracker: Tracker, options: BaseModel | None = None) -> dict[int, dict[str, float]]:
    assert isinstance(tracker, Tracker), f"{tracker!r} lacks attributes of the Tracker protocol"
    assert isinstance(tracker.name, str) and tracker.name and tracker.description
    schema = tracker.options
    assert issubclass(schema, BaseModel), "options must be a pydantic model"
    defaults = schema.model_validate({})
    try:
        schema.model_validate({"no_such_option_xyz": 1})
    except ValidationError:
        pass
    else:
        raise AssertionError("the options model must refuse unknown options (extra='forbid')")
    stored = check_read_back(tracker, options or defaults)
    with tempfile.TemporaryDirectory(prefix=f"miles-tracker-{tracker.name}-") as tmp:
        first, second = PROBE_RECORDS
        sink = tracker.open(TrackerRun(Path(tmp), "resume", {}), options or defaults)
        sink.log(0, first)
        sink.close()
        sink.close()  # idempotent
        resumed = tracker.open(TrackerRun(Path(tmp), "resume", {}, resume=True, first_step=1), options or defaults)
        resumed.log(1, second)
        resumed.close()
        steps = resumed.read_back()
        assert {0, 1} <= steps.keys(), f"after a resume the store holds steps {sorted(steps)}, expected 0 and 1"
    tracker.verify()
    return stored
