"""On a real ROCm GPU: an async checkpoint save forks its writer, and a later fork survives.

This is the path that segfaulted on ROCm when the async writer staged its device-to-host copies
in pinned memory. It runs on the MI350 runners; elsewhere it is collected and skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from miles_rocm.ci import register_rocm_ci

register_rocm_ci(est_time=120, suite="stage-c-4-gpu-mi350", labels=["rocm"], num_gpus=4)

pytestmark = pytest.mark.skipif(
    not (torch.version.hip and torch.cuda.is_available()), reason="needs a HIP build of torch and an AMD GPU"
)


def save_async_then_fork(checkpoint_dir: Path) -> str:
    """Save GPU tensors with megatron's async writer, fork, load back; return the guard status."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from miles_core.hardware import activate
    from miles_core.hardware.megatron_state import single_rank_parallel_state

    hardware = activate()
    assert hardware.name == "rocm", hardware.selection.reason
    with single_rank_parallel_state(seed=0):
        torch.cuda.set_device(0)
        weights = {name: torch.randn(256, 64, device="cuda") for name in ("embedding", "head")}

        def sharded(tensors):
            return {
                name: ShardedTensor.from_rank_offsets(name, t, replica_id=0) for name, t in tensors.items()
            }

        request = dist_checkpointing.save(sharded(weights), str(checkpoint_dir), async_sharded_save=True)
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)  # stages to the host, then forks the writer
        queue.maybe_finalize_async_calls(blocking=True)
        assert queue.get_num_unfinalized_calls() == 0

        pid = os.fork()
        if pid == 0:  # the child touches host memory the writer staged through, then leaves
            os._exit(0 if torch.ones(1).item() == 1.0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0

        template = {name: torch.empty_like(t) for name, t in weights.items()}
        loaded = dist_checkpointing.load(sharded(template), str(checkpoint_dir))
        for name, tensor in weights.items():
            assert torch.equal(loaded[name].cuda(), tensor), name
    return hardware.fix("checkpoint-guard").status


def test_async_checkpoint_save_and_fork_on_rocm(tmp_path: Path) -> None:
    assert save_async_then_fork(tmp_path / "ckpt") in ("upstream", "fallback")
