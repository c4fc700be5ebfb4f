"""megatron's real async checkpoint path on CPU under a simulated HIP build, guard on and off.

The cpu backend makes megatron run here; the guard is installed on its own (one backend per
process). Without the guard the writer stages non-blocking copies before it forks: the copy
pattern that segfaults on ROCm. With it, every copy is blocking and the round trip still holds.
"""

from __future__ import annotations

import pytest
import torch
from miles_rocm.checkpoint import CheckpointGuard

from miles_core.ci.register import register_cpu_ci
from miles_core.hardware import activate

register_cpu_ci(est_time=11, suite="stage-a-cpu")


@pytest.mark.parametrize("guarded", [True, False], ids=["guard", "no-guard"])
def test_async_save_copies_blocking_only_with_the_guard(
    guarded, tmp_path, miles_pm_factory, monkeypatch, async_checkpoint_roundtrip
) -> None:
    torch.set_num_threads(1)
    hardware = activate(miles_pm_factory(builtins=True))
    assert hardware.name == "cpu"
    monkeypatch.setattr(torch.version, "hip", "6.4.43484")
    guard = CheckpointGuard()
    if guarded:
        guard.install()
    try:
        copies = async_checkpoint_roundtrip(tmp_path / "ckpt", hardware.device)
    finally:
        guard.remove()
    non_blocking = sum(copies)
    assert copies
    assert non_blocking == 0 if guarded else non_blocking > 0
