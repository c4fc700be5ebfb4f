"""miles-e2b is discovered through its entry point, contributes the e2b provider, loads cheaply."""

from __future__ import annotations

import subprocess
import sys

from miles_core.ci.register import register_cpu_ci
from miles_core.plugins import MilesPluginManager

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def test_discovered_through_entry_point() -> None:
    pm = MilesPluginManager()
    pm.discover()
    record = pm.get("miles-e2b")
    assert record.distribution == "miles-e2b"
    assert record.status == "ok", record.reason
    assert not record.builtin
    assert [c.name for c in pm.contributions("sandbox") if c.plugin is record] == ["e2b"]


def test_registration_does_not_import_the_sdk() -> None:
    code = (
        "import sys, miles_e2b.plugin as p; specs = p.miles_sandbox_providers(); "
        "assert specs[0].name == 'e2b'; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('e2b', 'httpx', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
