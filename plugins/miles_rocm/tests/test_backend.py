"""The rocm backend: detection on a (simulated) HIP build, selection, worker env, device checks."""

from __future__ import annotations

import miles_rocm.plugin
import pytest
import torch
from miles_rocm.backend import ROLLOUT_DEFAULTS, WORKER_DEFAULTS, RocmBackend

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.hardware import activate
from miles_core.testing.hardware import assert_backend_conforms, cpu_only_torch

register_cpu_ci(est_time=10, suite="stage-a-cpu")

HIP = "6.4.43484"


@pytest.fixture
def hip_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A HIP build of torch that sees 8 GPUs."""
    monkeypatch.setattr(torch.version, "hip", HIP)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


@pytest.fixture
def no_tuning_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*WORKER_DEFAULTS, *ROLLOUT_DEFAULTS):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def pm(miles_pm_factory):
    return miles_pm_factory(plugins=[("miles-rocm", miles_rocm.plugin)], builtins=True)


def test_rocm_backend_conforms(hip_machine) -> None:
    assert_backend_conforms(RocmBackend())


def test_a_hip_build_with_gpus_is_claimed(hip_machine) -> None:
    detection = RocmBackend().detect()
    assert detection.claimed
    assert detection.reason == f"torch {torch.__version__} (HIP {HIP} build) sees 8 GPU(s)"


def test_a_hip_build_without_gpus_is_declined(hip_machine, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not RocmBackend().detect().claimed


@cpu_only_torch
def test_this_cpu_build_is_declined() -> None:
    detection = RocmBackend().detect()
    assert not detection.claimed
    assert detection.reason == f"torch {torch.__version__} (CPU-only build) is not a HIP build"


def test_rocm_is_selected_on_a_hip_machine(hip_machine, pm) -> None:
    hardware = activate(pm)
    assert hardware.name == "rocm"
    assert hardware.selection.selected_by == "detection"
    claims = {c.contribution.name: c.detection.claimed for c in hardware.selection.candidates}
    assert claims == {"cpu": False, "cuda": False, "rocm": True}
    assert hardware.device == torch.device("cuda")
    assert hardware.distributed_backend == "nccl"
    assert hardware.backend.device_count() == 8
    assert not hardware.supports("pinned_memory_async_copy")


def test_override_selects_rocm_on_this_cpu_machine(pm, monkeypatch) -> None:
    monkeypatch.setenv("MILES_HARDWARE", "rocm")
    hardware = activate(pm)
    assert (hardware.name, hardware.selection.selected_by) == ("rocm", "override")
    assert "is not a HIP build" in hardware.selection.reason
    hardware.prepare("megatron")
    assert hardware.fix("checkpoint-guard").status in ("upstream", "fallback")


def test_rocm_names_the_ci_kind_this_plugin_contributes(pm) -> None:
    kinds = {c.name: c.plugin.name for c in pm.contributions("ci")}
    assert kinds[RocmBackend.ci_hardware] == "miles-rocm"


def test_worker_env_snapshots(no_tuning_exports) -> None:
    backend = RocmBackend()
    train = {
        "MILES_HARDWARE": "rocm",
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "HIP_FORCE_DEV_KERNARG": "1",
        "HSA_NO_SCRATCH_RECLAIM": "1",
        "HSA_ENABLE_IPC_MODE_LEGACY": "1",
        "NCCL_MIN_NCHANNELS": "112",
    }
    assert backend.worker_env("train") == train
    assert backend.worker_env("rollout") == {**train, "SGLANG_USE_AITER": "1"}


def test_exported_tuning_values_win_over_the_defaults(no_tuning_exports, monkeypatch) -> None:
    monkeypatch.setenv("NCCL_MIN_NCHANNELS", "32")
    monkeypatch.setenv("MILES_HARDWARE", "cpu")  # the backend's own name is never taken from outside
    env = RocmBackend().worker_env("train")
    assert (env["NCCL_MIN_NCHANNELS"], env["MILES_HARDWARE"]) == ("32", "rocm")


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"ROCR_VISIBLE_DEVICES": "0,1"}, "ROCR_VISIBLE_DEVICES is set without HIP_VISIBLE_DEVICES"),
        ({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "2,3"}, "disagree"),
        ({"HIP_VISIBLE_DEVICES": "0 1"}, "HIP_VISIBLE_DEVICES='0 1'"),
    ],
)
def test_inconsistent_device_visibility_fails_verification(monkeypatch, env, error) -> None:
    for var in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=error):
        RocmBackend().verify()


def test_consistent_device_visibility_passes(monkeypatch) -> None:
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1,2,3")
    backend = RocmBackend()
    try:
        backend.apply()
        backend.verify()
    finally:
        backend.revert()
