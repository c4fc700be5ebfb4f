"""Run megatron-core in one process: ``parallel_state`` at world size 1, on the active backend,
and read the per-depth MTP losses its training forwards record.

Used by tests and tools that build small megatron models (the mtp plugin, the megatron trainer
backend on CPU)::

    from miles_core.hardware.megatron_state import causal_attention_mask, single_rank_parallel_state

    with single_rank_parallel_state(seed=0) as hw:
        model = GPTModel(config=TransformerConfig(..., use_cpu_initialization=True), ...).to(hw.device)
        logits = model(input_ids, position_ids, causal_attention_mask(seq_len, hw.device))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles_core.errors import MilesError
from miles_core.hardware.activation import ActiveHardware, activate

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def single_rank_parallel_state(
    seed: int = 1234, hardware: ActiveHardware | None = None
) -> Iterator[ActiveHardware]:
    """Prepare megatron-core on the active backend (its fixes, e.g. the cpu backend's), initialise
    ``torch.distributed`` (if needed) and megatron's ``parallel_state`` at world size 1 with the
    backend's collective library (gloo on CPU), seed torch and megatron's RNG
    tracker, and tear all of it down on exit.

    An already initialised ``torch.distributed`` of world size 1 is used and left running; an
    already initialised ``parallel_state`` is an error (nesting would destroy the caller's).
    """
    import torch
    import torch.distributed as dist

    hw = hardware if hardware is not None else activate()
    hw.prepare("megatron")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        raise MilesError("megatron's parallel_state is already initialised in this process")
    owns_process_group = not dist.is_initialized()
    if owns_process_group:
        dist.init_process_group(hw.distributed_backend, store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise MilesError(
            f"torch.distributed is already initialised with world size {dist.get_world_size()}, not 1"
        )
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        yield hw
    finally:
        parallel_state.destroy_model_parallel()
        if owns_process_group:
            dist.destroy_process_group()


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """megatron's causal mask (``True`` = masked), shape ``[1, 1, seq_len, seq_len]``.

    Pass it explicitly off CUDA: megatron builds its default mask with ``device="cuda"``.
    """
    import torch

    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def _mtp_tracker() -> tuple[dict[str, Any], tuple[str, ...]]:
    """megatron-core's MTP logging tracker and the keys of its per-depth tensors, loss sums first.

    Releases differ: those whose ``MTPLossLoggingHelper`` has ``save_loss_to_tracker`` (0.16) keep
    the losses under ``"values"``; those with ``save_metrics_to_tracker`` (0.19) under
    ``"loss_values"``, beside the depths' acceptance counts."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker"):
        return MTPLossLoggingHelper.tracker, ("loss_values", "correct_values", "total_values")
    if hasattr(MTPLossLoggingHelper, "save_loss_to_tracker"):
        return MTPLossLoggingHelper.tracker, ("values",)
    raise MilesError(
        "this megatron-core's MTPLossLoggingHelper has neither save_loss_to_tracker nor "
        "save_metrics_to_tracker: where it records MTP losses is unknown"
    )


def mtp_loss_sums() -> torch.Tensor | None:
    """The MTP losses megatron-core recorded since :func:`clear_mtp_loss_records`, one per depth:
    each training-mode forward adds its depth's mean token loss. None when none was recorded."""
    tracker, keys = _mtp_tracker()
    return tracker.get(keys[0])


def clear_mtp_loss_records() -> None:
    """Drop megatron-core's per-depth MTP records; its next training forward starts them anew."""
    tracker, keys = _mtp_tracker()
    for key in keys:
        tracker.pop(key, None)
