"""Device questions the rest of miles asks, answered by the active hardware backend.

This module (with the backends themselves) is the only place that talks to a device runtime
(``torch.cuda`` and its kin): trainers, checkpoints, the engine's loader and the model patches
ask here instead of branching on the platform. The runtime is the torch device module of the
active backend's ``device_type`` (``torch.cuda`` for CUDA and ROCm builds).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles_core.errors import ConfigError

if TYPE_CHECKING:
    import torch


def _runtime(device_type: str) -> Any:
    """torch's module for ``device_type`` (``torch.cuda``, ...), or None for the host."""
    import torch

    if device_type == "cpu":
        return None
    return torch.get_device_module(device_type)


def resolve_device(setting: str, what: str = "device") -> torch.device:
    """``auto``: the active backend's device; otherwise ``setting``, checked to exist here.

    ``what`` names the setting in errors (``trainer.device``).
    """
    import torch

    from miles_core.hardware.activation import activate

    if setting == "auto":
        return activate().device
    try:
        device = torch.device(setting)
    except RuntimeError as exc:
        raise ConfigError(f"{what}: {setting!r} is not a device ({exc})") from None
    runtime = _runtime(device.type)
    if runtime is None:
        return device
    if not runtime.is_available():
        raise ConfigError(f"{what}: {setting!r} requested but {device.type.upper()} is not available")
    if device.index is not None and device.index >= runtime.device_count():
        raise ConfigError(f"{what}: {setting!r} requested but only {runtime.device_count()} device(s) are visible")
    return device


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device data-parallel rank ``rank`` computes on: device index ``rank`` of an
    accelerator; ranks on the host share it."""
    import torch

    runtime = _runtime(device.type)
    if runtime is None:
        return device
    if rank >= runtime.device_count():
        raise ConfigError(
            f"trainer.world_size needs one device per rank; rank {rank} has none "
            f"({runtime.device_count()} visible)"
        )
    return torch.device(device.type, rank)


def bind_device(device: torch.device) -> None:
    """Make ``device`` this process's current device (collectives and allocations default to it)."""
    runtime = _runtime(device.type)
    if runtime is not None:
        runtime.set_device(device)


def graph_runtime(device: torch.device) -> Any:
    """The device runtime whose graph API captures and replays work on ``device`` (``torch.cuda``
    on CUDA and ROCm builds: ``CUDAGraph``, ``graph``, ``graph_pool_handle``, streams), or ``None``
    when the active backend does not claim ``device_graphs`` for it."""
    if not device_supports(device, "device_graphs"):
        return None
    return _runtime(device.type)


def completion_event(device: torch.device) -> Any:
    """A new event of ``device``'s runtime (``record()`` it after queued work, ``synchronize()`` to
    wait for that work), or ``None`` for the host, where queued work has already run."""
    runtime = _runtime(device.type)
    return None if runtime is None else runtime.Event()


def distributed_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend for collectives over tensors on ``device``: the active
    hardware backend's (gloo, nccl, ...) for its own device type; for host memory under an
    accelerator's backend (ranks on the host of a GPU machine), which that backend cannot
    reduce, the CPU backend's."""
    from miles_core.hardware.activation import activate
    from miles_core.hardware.cpu import CpuBackend

    backend = activate().backend
    if device.type == "cpu" and backend.device_type != "cpu":
        return CpuBackend.distributed_backend
    return backend.distributed_backend


def device_supports(device: torch.device, capability: str) -> bool:
    """Whether the active backend offers ``capability`` for tensors on ``device``.

    Capabilities (:data:`~miles_core.hardware.base.CAPABILITIES`) are the accelerator's: a
    tensor in host memory, or on a device of another type than the backend's, has none.
    """
    if device.type == "cpu":
        return False
    from miles_core.hardware.activation import activate

    hardware = activate()
    return device.type == hardware.backend.device_type and hardware.supports(capability)


def device_rng_state() -> list[torch.Tensor] | None:
    """The generator states of every device of the active backend (None on the host)."""
    from miles_core.hardware.activation import activate

    runtime = _runtime(activate().backend.device_type)
    return None if runtime is None or not runtime.is_available() else runtime.get_rng_state_all()


def restore_device_rng_state(state: list[torch.Tensor] | None) -> None:
    """Restore what :func:`device_rng_state` returned (nothing to do for None)."""
    if state is None:
        return
    from miles_core.hardware.activation import activate

    runtime = _runtime(activate().backend.device_type)
    if runtime is None or not runtime.is_available():
        raise ConfigError("the checkpoint holds device generator states, but this process has no such device")
    runtime.set_rng_state_all(state)


def to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` in host memory, made the way the backend's ``checkpoint_io`` says.

    ``pinned-non-blocking`` (and the backend claims ``pinned_memory_async_copy``): every copy is
    issued into pinned host memory without waiting, then the device is synchronised once.
    ``pageable-blocking``: one blocking copy per tensor. ``host-only``: tensors already on the
    host are returned as they are.
    """
    from miles_core.hardware.activation import activate

    hardware = activate()
    policy = hardware.checkpoint_io.d2h_copy
    on_device = {k: v for k, v in tensors.items() if v.device.type != "cpu"}
    out = {k: v for k, v in tensors.items() if k not in on_device}
    if not on_device:
        return out
    if policy == "pinned-non-blocking" and hardware.supports("pinned_memory_async_copy"):
        import torch

        for name, tensor in on_device.items():
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            out[name] = host.copy_(tensor, non_blocking=True)
        runtime = _runtime(hardware.backend.device_type)
        if runtime is not None:
            runtime.synchronize()
    else:
        out.update({k: v.to("cpu") for k, v in on_device.items()})
    return {k: out[k] for k in tensors}
