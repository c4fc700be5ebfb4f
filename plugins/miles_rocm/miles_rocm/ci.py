"""ROCm CI: the ``register_rocm_ci`` marker and the ``rocm`` CI hardware kind.

The marker is a runtime no-op like the core markers; ``miles ci`` finds calls by parsing source::

    from miles_rocm.ci import register_rocm_ci

    register_rocm_ci(est_time=600, suite="stage-c-4-gpu-mi350", labels=["rocm"], num_gpus=4)

The kind runs jobs in a ROCm container on self-hosted AMD runners. One 8-GPU host typically
serves as two 4-GPU runners: each runner service sets ``HIP_VISIBLE_DEVICES`` (``0,1,2,3`` and
``4,5,6,7``), the job forwards it into the container, and the generated device check fails the
job unless the tests see exactly the suite's GPU count.
"""

from __future__ import annotations

from collections.abc import Mapping

from miles_core.ci.base import GPUHardware, HardwareSettings, Suite


def register_rocm_ci(
    est_time: float,
    suite: str,
    *,
    labels: list[str] | None = None,
    nightly: bool = False,
    disabled: str | None = None,
    issue: str | None = None,
    num_gpus: int | None = None,
    layout: Mapping[str, int] | None = None,
) -> None:
    """Run this file on ROCm runners in ``suite`` (``num_gpus`` and ``layout`` are checked
    against the suite's GPUs per runner when the registration is discovered)."""


ROCM = GPUHardware(
    name="rocm",
    marker="miles_rocm.ci:register_rocm_ci",
    description="self-hosted AMD Instinct runners (ROCm container per job)",
    self_hosted=True,
    # ROCm bring-up still loses workers to driver resets and RCCL hangs; test failures are not retried
    retriable=frozenset({"crash", "timeout"}),
    labels={"rocm": "needs an AMD ROCm GPU runner"},
    default_settings=HardwareSettings(
        install=("python3 -m pip install -e . -e plugins/miles_rocm",),
        image="rocm/pytorch:rocm7.2.1_ubuntu24.04_py3.12_pytorch_release_2.9.1@sha256:96a2fb24dec9896e2f8238178f0c49d0dcc4c7dcc597be09e4564316bd86d191",
    ),
    default_suites=(
        Suite(
            name="stage-c-4-gpu-mi350",
            hardware="rocm",
            runs_on=("self-hosted", "amd", "mi350", "4gpu"),
            gpus=4,
            host_gpus=8,
            shards=2,
            labels=("rocm",),
            timeout_minutes=120,
            source="miles-rocm default",
        ),
    ),
    visible_devices_env="HIP_VISIBLE_DEVICES",
    driver_probe="rocm-smi",
    device_options=(
        "--device=/dev/kfd",
        "--device=/dev/dri",
        "--group-add=video",
        "--ipc=host",
        "--shm-size=16g",
    ),
)
