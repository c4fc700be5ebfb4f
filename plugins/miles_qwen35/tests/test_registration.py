"""miles-qwen35 is discovered through its entry point and loads cleanly."""

from miles_core.ci.register import register_cpu_ci
from miles_core.plugins import MilesPluginManager

register_cpu_ci(est_time=5, suite="stage-a-cpu")


def test_discovered_through_entry_point() -> None:
    pm = MilesPluginManager()
    pm.discover()
    record = pm.get("miles-qwen35")
    assert record.distribution == "miles-qwen35"
    assert record.status == "ok", record.reason
    assert not record.builtin
