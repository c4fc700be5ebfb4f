"""megatron-core is imported only by jobs that use it: activation and an hf model's preparation
leave it alone (it takes seconds to import), ``prepare("megatron")`` brings it in with its fixes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.hardware.base import ENV_OVERRIDE

register_cpu_ci(est_time=15, suite="stage-a-cpu")

pytest.importorskip("megatron.core")

PROGRAM = """
import json, sys
from transformers import AutoModelForCausalLM
from miles_core.engine.presets import preset_dir
from miles_core.hardware import activate
from miles_core.patches import prepare_model

hardware = activate()
report = prepare_model(AutoModelForCausalLM.from_pretrained(preset_dir("tiny-rl")))
before = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
hardware.prepare("megatron")
print(json.dumps({"before": before, "after": "megatron.core" in sys.modules,
                  "patches": [p.name for p in report.patches], "fixes": [f.name for f in hardware.all_fixes()]}))
"""


def test_an_hf_job_imports_megatron_only_when_it_prepares_it() -> None:
    # the cpu backend, whose megatron fixes are named below, also on a host with a GPU
    env = {**os.environ, ENV_OVERRIDE: "cpu"}
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["before"] == [], "activation or preparing an hf model imported megatron"
    assert "gdn-packing" in seen["patches"]  # the patches did run on the model
    assert seen["after"] and "megatron-cpu" in seen["fixes"]
