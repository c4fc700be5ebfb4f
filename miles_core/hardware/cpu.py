"""The cpu backend: the embedded default, claimed whenever torch sees no GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_core.hardware.base import (
    CheckpointIOPolicy,
    Detection,
    FixReport,
    HardwareBackend,
    check_library,
    torch_build,
)

if TYPE_CHECKING:
    from miles_core.hardware.megatron_cpu import MegatronCpuFixes


class CpuBackend(HardwareBackend):
    name = "cpu"
    device_type = "cpu"
    distributed_backend = "gloo"
    visible_devices_env = None
    ray_noset_envs = ()
    capabilities = frozenset()
    ci_hardware = "cpu"
    checkpoint_io = CheckpointIOPolicy("host-only", "tensors already live in host memory")

    def __init__(self) -> None:
        self._megatron: MegatronCpuFixes | None = None

    def detect(self) -> Detection:
        import torch

        if torch.cuda.is_available():
            return Detection(False, f"{torch_build()} sees {torch.cuda.device_count()} GPU(s)")
        return Detection(True, f"{torch_build()} sees no GPU")

    def device_count(self) -> int:
        return 1

    def prepare(self, library: str) -> list[FixReport]:
        check_library(library)
        fixes = self._megatron_fixes()
        report = fixes.apply()
        try:
            fixes.verify()
        except BaseException:
            fixes.revert()
            raise
        return [report]

    def revert(self) -> None:
        if self._megatron is not None:
            self._megatron.revert()

    def _megatron_fixes(self) -> MegatronCpuFixes:
        if self._megatron is None:  # imported here: plugin discovery must not pay for it
            from miles_core.hardware.megatron_cpu import MegatronCpuFixes

            self._megatron = MegatronCpuFixes()
        return self._megatron
