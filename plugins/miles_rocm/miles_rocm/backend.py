"""The rocm backend: AMD GPUs through a HIP build of torch.

Importing this module stays cheap; torch is imported when the backend is detected, megatron-core
only when a job prepares it (``activate().prepare("megatron")``), which installs the async-checkpoint
guard.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from miles_core.errors import ConfigError
from miles_core.hardware.base import (
    CheckpointIOPolicy,
    Detection,
    FixReport,
    HardwareBackend,
    check_library,
    parse_visible_devices,
    torch_build,
)

if TYPE_CHECKING:
    from miles_rocm.checkpoint import CheckpointGuard

#: tuning defaults for every ROCm worker; a value already exported in the environment wins
WORKER_DEFAULTS: dict[str, str] = {
    "HIP_FORCE_DEV_KERNARG": "1",  # kernel arguments in device memory: lower launch latency
    "HSA_NO_SCRATCH_RECLAIM": "1",  # keep scratch memory allocated between kernels
    "HSA_ENABLE_IPC_MODE_LEGACY": "1",  # colocated train + rollout leak VRAM with the newer IPC mode
    "NCCL_MIN_NCHANNELS": "112",  # RCCL channels for MI300-class bandwidth
}
#: extra defaults for rollout (SGLang) workers
ROLLOUT_DEFAULTS: dict[str, str] = {"SGLANG_USE_AITER": "1"}  # AMD's AITER kernels in SGLang


class RocmBackend(HardwareBackend):
    name = "rocm"
    device_type = "cuda"  # HIP builds of torch expose AMD GPUs as "cuda" devices
    distributed_backend = "nccl"  # RCCL, behind torch's nccl backend name
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    # Ray falls back to its NVIDIA manager (CUDA_VISIBLE_DEVICES, which HIP also honours) when it
    # cannot query AMD GPUs, so both variables are pinned.
    ray_noset_envs = (
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    )
    capabilities = frozenset({"triton", "device_graphs"})
    ci_hardware = "rocm"  # the CI kind in miles_rocm.ci
    checkpoint_io = CheckpointIOPolicy(
        "pageable-blocking",
        "a process forked after pinned-memory staging segfaults on ROCm (the async checkpoint writer forks)",
    )

    def __init__(self) -> None:
        self._guard: CheckpointGuard | None = None

    def detect(self) -> Detection:
        import torch

        if not torch.version.hip:
            return Detection(False, f"{torch_build()} is not a HIP build")
        if not torch.cuda.is_available():
            return Detection(False, f"{torch_build()} sees no GPU")
        return Detection(True, f"{torch_build()} sees {torch.cuda.device_count()} GPU(s)")

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count() if torch.version.hip else 0

    def role_env(self, role: str) -> dict[str, str]:
        defaults = dict(WORKER_DEFAULTS)
        if role == "rollout":
            defaults.update(ROLLOUT_DEFAULTS)
        return {var: os.environ.get(var, value) for var, value in defaults.items()}

    def prepare(self, library: str) -> list[FixReport]:
        check_library(library)
        from miles_core.hardware.megatron_cpu import megatron_installed

        if not megatron_installed():
            return [FixReport("checkpoint-guard", "not-needed", "megatron-core is not installed")]
        from miles_rocm.checkpoint import CheckpointGuard, verify_guard

        if self._guard is None:
            self._guard = CheckpointGuard()
        report = self._guard.install()
        try:
            verify_guard()
        except BaseException:
            self._guard.remove()
            raise
        return [report]

    def revert(self) -> None:
        if self._guard is not None:
            self._guard.remove()

    def verify(self) -> None:
        super().verify()
        _check_visible_devices(os.environ)


def _check_visible_devices(environ: Mapping[str, str]) -> None:
    """Reject device-visibility settings that make Ray or other tools disagree with torch."""
    hip = parse_visible_devices("HIP_VISIBLE_DEVICES", environ)
    cuda = parse_visible_devices("CUDA_VISIBLE_DEVICES", environ)
    rocr = parse_visible_devices("ROCR_VISIBLE_DEVICES", environ)
    if rocr is not None and hip is None:
        raise ConfigError(
            "ROCR_VISIBLE_DEVICES is set without HIP_VISIBLE_DEVICES: Ray refuses it on AMD nodes; "
            "select devices with HIP_VISIBLE_DEVICES"
        )
    if hip is not None and cuda is not None and hip != cuda:
        raise ConfigError(
            f"HIP_VISIBLE_DEVICES={','.join(hip)} and CUDA_VISIBLE_DEVICES={','.join(cuda)} disagree: "
            "torch on ROCm follows HIP_VISIBLE_DEVICES, tools reading CUDA_VISIBLE_DEVICES would pick "
            "other devices; unset CUDA_VISIBLE_DEVICES or make them equal"
        )
