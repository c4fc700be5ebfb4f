"""Golden pins: for each scripted scenario and each version, the exact bytes sent upstream, the
exact bytes returned to the client, every status, the samples and the final state.

Regenerate after an intended change with ``MILES_UPDATE_GOLDEN=1 pytest tests/session/test_pins.py``
and review the diff of ``tests/session/golden/``.
"""

import json
import os
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=7, suite="stage-a-cpu")

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_golden(scenario, version, run_scenario) -> None:
    document = run_scenario(scenario, version)
    path = GOLDEN / version / f"{scenario}.json"
    if os.environ.get("MILES_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    assert path.exists(), f"no golden file {path}; run with MILES_UPDATE_GOLDEN=1 to create it"
    assert document == json.loads(path.read_text())
