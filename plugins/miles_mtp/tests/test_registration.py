"""miles-mtp is discovered through its entry point, loads cheaply and contributes its patch."""

from __future__ import annotations

import subprocess
import sys

from miles_core.ci.register import register_cpu_ci
from miles_core.plugins import MilesPluginManager

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def test_discovered_through_entry_point() -> None:
    pm = MilesPluginManager()
    pm.discover()
    record = pm.get("miles-mtp")
    assert record.distribution == "miles-mtp"
    assert record.status == "ok", record.reason
    assert not record.builtin
    assert [c.name for c in pm.contributions("patches") if c.plugin is record] == ["mtp-labels"]


def test_discovery_imports_no_heavy_module() -> None:
    code = (
        "import sys, miles_mtp.plugin as p; patch, = p.miles_model_patches(); "
        "patch.matches(None); "
        "print(sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
