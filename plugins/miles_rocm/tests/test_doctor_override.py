"""``MILES_HARDWARE=rocm miles doctor --json`` on a CPU machine: rocm by override, guard status, and
the one check that cannot pass without the backend's collectives (RCCL, torch's "nccl")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch.distributed
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from miles_rocm.checkpoint import observe_copy_mode

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=24, suite="stage-a-cpu")


def test_doctor_reports_rocm_by_override_and_the_guard_status() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "miles_core", "doctor", "--json"],
        env={**os.environ, "MILES_HARDWARE": "rocm"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    results = json.loads(proc.stdout)["results"]
    # megatron's trainer check starts a process group on the backend's collective library; a CPU
    # build of torch has none, a GPU build without a GPU cannot start one, and the doctor says so
    # rather than passing it
    failed = {(r["concern"], r["item"]) for r in results if r["status"] == "fail"}
    collectives = torch.distributed.is_nccl_available() and torch.cuda.is_available()
    assert failed == (set() if collectives else {("train", "trainer megatron")}), failed
    assert proc.returncode == (1 if failed else 0), proc.stderr[-2000:]
    hardware = {r["item"]: r for r in results if r["concern"] == "hardware"}
    backend = hardware["backend"]
    assert backend["status"] == "ok", backend["detail"]
    assert (backend["data"]["backend"], backend["data"]["plugin"]) == ("rocm", "miles-rocm")
    assert backend["data"]["selected_by"] == "override"
    assert backend["data"]["reason"].startswith("MILES_HARDWARE=rocm (detection: ")
    assert backend["data"]["worker_env"]["train"]["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1"

    expected = "upstream" if observe_copy_mode(FileSystemWriterAsync) == "pageable-blocking" else "fallback"
    guard = hardware["checkpoint-guard"]
    assert (guard["status"], guard["data"]["status"]) == ("ok", expected)
    assert backend["data"]["fixes"]["checkpoint-guard"]["status"] == expected
    assert hardware["ci-hardware"]["detail"] == "rocm (marker miles_rocm.ci:register_rocm_ci)"
