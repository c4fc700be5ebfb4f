"""Built-in plugin ``core-ci``: the cpu and cuda CI hardware kinds.

Registered through the entry point ``core-ci`` in group ``miles.plugins``, like any plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_core.ci.base import CIHardware, GPUHardware, HardwareSettings, Suite, pinned
from miles_core.hookspecs import hookimpl


@dataclass(frozen=True)
class CPUHardware(CIHardware):
    """GitHub-hosted CPU runners: set up Python, then install."""

    def setup_steps(self, settings: HardwareSettings) -> list[dict[str, Any]]:
        return [
            {
                "name": "Set up Python",
                "id": "setup-python",
                "uses": pinned("actions/setup-python"),
                "with": {"python-version": settings.python},
            }
        ]


CPU = CPUHardware(
    name="cpu",
    marker="miles_core.ci.register:register_cpu_ci",
    description="GitHub-hosted CPU runners",
    default_settings=HardwareSettings(install=("python3 -m pip install -e .",)),
    default_suites=(
        Suite(name="stage-a-cpu", hardware="cpu", runs_on=("ubuntu-latest",), source="core-ci default"),
    ),
)

CUDA = GPUHardware(
    name="cuda",
    marker="miles_core.ci.register:register_cuda_ci",
    description="self-hosted NVIDIA GPU runners (container per job)",
    self_hosted=True,
    retriable=frozenset({"crash"}),
    labels={"gpu": "needs a CUDA GPU runner"},
    default_settings=HardwareSettings(
        install=("python3 -m pip install -e .",),
        image="pytorch/pytorch:2.9.0-cuda12.8-cudnn9-devel@sha256:97ec2a667dd7560c615bf50a95b2fb85a673ae233a55da1706e8e04e6d6d518e",
    ),
    default_suites=(
        Suite(
            name="stage-b-1-gpu-h200",
            hardware="cuda",
            runs_on=("self-hosted", "h200", "1gpu"),
            gpus=1,
            labels=("gpu",),
            source="core-ci default",
        ),
    ),
    visible_devices_env="CUDA_VISIBLE_DEVICES",
    driver_probe="nvidia-smi",
    device_options=("--gpus", "all", "--ipc=host", "--shm-size=16g"),
)


@hookimpl
def miles_ci_hardware() -> list[CIHardware]:
    return [CPU, CUDA]
