"""miles-qwen35 is discovered through its entry point, loads cheaply and contributes its patch."""

from __future__ import annotations

import subprocess
import sys

from miles_core.ci.register import register_cpu_ci
from miles_core.plugins import MilesPluginManager

register_cpu_ci(est_time=3, suite="stage-a-cpu")


def test_discovered_through_entry_point() -> None:
    pm = MilesPluginManager()
    pm.discover()
    record = pm.get("miles-qwen35")
    assert record.distribution == "miles-qwen35"
    assert record.status == "ok", record.reason
    assert not record.builtin
    assert [c.name for c in pm.contributions("patches") if c.plugin is record] == ["gdn-packing"]


def test_discovery_imports_no_heavy_module() -> None:
    code = (
        "import sys, miles_qwen35.plugin as p; patches = p.miles_model_patches(); "
        "patches[0].matches(None); "
        "print(sorted(m for m in ('torch', 'transformers', 'fla') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
