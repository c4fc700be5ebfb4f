"""Fixtures for miles-rocm's tests: no active backend around each test, and an async-checkpoint
round trip shared by the CPU test (simulated HIP) and the ROCm runner test (real HIP)."""

from __future__ import annotations

import os
from collections.abc import Callable
from inspect import signature
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from miles_core.hardware.megatron_state import single_rank_parallel_state
from miles_core.testing.hardware import no_active_hardware  # noqa: F401

if TYPE_CHECKING:
    import torch


def save_async_then_fork(checkpoint_dir: Path, device: torch.device) -> list[bool]:
    """Save tensors with megatron's async writer (it forks), fork once more, load them back.

    Returns the ``non_blocking`` flag of every ``Tensor.to`` made during the save.
    """
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    def sharded(tensors: dict[str, torch.Tensor]) -> dict[str, ShardedTensor]:
        return {name: ShardedTensor.from_rank_offsets(name, t, replica_id=0) for name, t in tensors.items()}

    checkpoint_dir.mkdir(parents=True)
    copies: list[bool] = []
    real_to = torch.Tensor.to

    def recording_to(self: torch.Tensor, *args, **kwargs):
        copies.append(bool(torch._C._nn._parse_to(*args, **kwargs)[2]))
        return real_to(self, *args, **kwargs)

    with single_rank_parallel_state(seed=0):
        weights = {name: torch.randn(256, 64, device=device) for name in ("embedding", "head")}
        torch.Tensor.to = recording_to
        try:
            # releases that also offer nvidia-resiliency-ext's writer default to it (0.19): megatron's own
            strategy = {"async_strategy": "mcore"} if "async_strategy" in signature(dist_checkpointing.save).parameters else {}
            request = dist_checkpointing.save(sharded(weights), str(checkpoint_dir), async_sharded_save=True, **strategy)
            queue = AsyncCallsQueue()
            queue.schedule_async_request(request)  # stages to the host, then forks the writer
            queue.maybe_finalize_async_calls(blocking=True)
        finally:
            torch.Tensor.to = real_to
        assert queue.get_num_unfinalized_calls() == 0

        pid = os.fork()
        if pid == 0:  # the child touches host memory after the staged copies, then leaves
            os._exit(0 if torch.ones(1).item() == 1.0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0

        template = {name: torch.empty_like(t) for name, t in weights.items()}
        loaded = dist_checkpointing.load(sharded(template), str(checkpoint_dir))
        for name, tensor in weights.items():
            assert torch.equal(loaded[name].to(device), tensor), name
    return copies


@pytest.fixture
def async_checkpoint_roundtrip() -> Callable[[Path, torch.device], list[bool]]:
    return save_async_then_fork
