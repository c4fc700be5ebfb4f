"""``miles doctor`` reports the selected backend, why, its fixes and its worker environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.testing.hardware import cpu_only_torch

register_cpu_ci(est_time=29, suite="stage-a-cpu")


def doctor_json(**env: str) -> tuple[int, dict[str, dict]]:
    """Run ``miles doctor --json``; return its exit code and its hardware results by item."""
    proc = subprocess.run(
        [sys.executable, "-m", "miles_core", "doctor", "--json"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(proc.stdout)
    return proc.returncode, {r["item"]: r for r in report["results"] if r["concern"] == "hardware"}


@cpu_only_torch
def test_doctor_reports_cpu_with_its_reason_fixes_and_worker_env() -> None:
    _, hardware = doctor_json()
    backend = hardware["backend"]
    assert backend["status"] == "ok"
    data = backend["data"]
    assert (data["backend"], data["plugin"], data["selected_by"]) == ("cpu", "core-hardware", "detection")
    assert data["reason"] == f"torch {torch.__version__} (CPU-only build) sees no GPU"
    assert data["worker_env"] == {"train": {"MILES_HARDWARE": "cpu"}, "rollout": {"MILES_HARDWARE": "cpu"}}
    assert data["distributed_backend"] == "gloo"
    assert hardware["megatron-cpu"]["status"] == "ok"
    assert hardware["megatron-cpu"]["data"]["status"] == "applied"
    assert hardware["candidate cuda"]["detail"].startswith("declines:")


def test_doctor_fails_on_an_unknown_override() -> None:
    code, hardware = doctor_json(MILES_HARDWARE="tpu")
    assert code == 1
    assert hardware["backend"]["status"] == "fail"
    assert "MILES_HARDWARE='tpu' names no registered hardware backend" in hardware["backend"]["detail"]
