"""On a real ROCm GPU: an async checkpoint save forks its writer, and a later fork survives.

This is the path that segfaulted on ROCm when the async writer staged its device-to-host copies
in pinned memory. It runs on the MI350 runners; elsewhere it is collected and skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from miles_rocm.ci import register_rocm_ci

from miles_core.hardware import activate

register_rocm_ci(est_time=120, suite="stage-c-4-gpu-mi350", labels=["rocm"], num_gpus=4)

pytestmark = pytest.mark.skipif(
    not (torch.version.hip and torch.cuda.is_available()), reason="needs a HIP build of torch and an AMD GPU"
)


def test_async_checkpoint_save_and_fork_on_rocm(tmp_path: Path, async_checkpoint_roundtrip) -> None:
    hardware = activate()
    assert hardware.name == "rocm", hardware.selection.reason
    hardware.prepare("megatron")
    assert hardware.fix("checkpoint-guard").status in ("upstream", "fallback")
    torch.cuda.set_device(0)
    copies = async_checkpoint_roundtrip(tmp_path / "ckpt", hardware.device)
    assert copies and not any(copies), f"{sum(copies)} of {len(copies)} host copies were non-blocking"
