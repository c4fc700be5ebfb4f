"""Make megatron-core usable on CPU: its device query, its device sync and its CUDA RNG tracker.

megatron-core allocates buffers on ``torch.cuda.current_device()`` (a few hundred call sites),
synchronizes the device before its async checkpoint writer forks, and seeds and forks the CUDA
generator around dropout and weight init through ``CudaRNGStatesTracker``. On a CPU-only build of
torch all of these raise "Torch not compiled with CUDA enabled". The cpu backend therefore:

* makes ``torch.cuda.current_device()`` return ``torch.device("cpu")``, so every megatron buffer
  is allocated on the host;
* makes ``torch.cuda.synchronize()`` return at once (there is no device work to wait for);
* makes ``CudaRNGStatesTracker.fork()`` a no-op (dropout then draws from torch's CPU generator,
  which ``torch.manual_seed`` controls) and ``CudaRNGStatesTracker.add()`` record its seeded
  state on a CPU generator, so ``model_parallel_cuda_manual_seed`` works.

Both are patched on the objects that own them (the ``torch.cuda`` module, the tracker class), so
every import path sees them. Transformer Engine's tracker is not covered (TE needs CUDA).
Callers still pass an explicit ``attention_mask``: megatron builds its default causal mask with
``device="cuda"`` (see :func:`miles_core.hardware.megatron.causal_attention_mask`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from typing import Any

from miles_core.hardware.base import FixReport
from miles_core.hardware.patching import AttributePatch

FIX_NAME = "megatron-cpu"


def megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no ``megatron`` namespace at all
        return False


def _cpu_current_device() -> Any:
    import torch

    return torch.device("cpu")


def _synchronize_nothing(device: Any = None) -> None:
    return None


def _fork_without_device_rng(self: Any, name: str | None = None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _add_without_device_rng(self: Any, name: str, seed: int) -> None:
    import torch

    if seed in self.seeds_:
        raise ValueError(f"seed {seed} already exists")
    if name in self.states_:
        raise ValueError(f"rng state {name} already exists")
    self._is_initialized = True
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


class MegatronCpuFixes:
    """The patches above, applied together, verified by behaviour, reversible."""

    def __init__(self) -> None:
        self._patches: list[AttributePatch] = []

    def apply(self) -> FixReport:
        if not megatron_installed():
            return FixReport(FIX_NAME, "not-needed", "megatron-core is not installed")
        if not self._patches:
            import torch

            with warnings.catch_warnings():
                # megatron announces at import that the CUDA-only Transformer Engine and Apex are
                # absent; on the CPU backend that is the expected state, not news.
                warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
                from megatron.core.tensor_parallel import random as megatron_random

            tracker = megatron_random.CudaRNGStatesTracker
            self._patches = [
                AttributePatch(torch.cuda, "current_device", _cpu_current_device),
                AttributePatch(torch.cuda, "synchronize", _synchronize_nothing),
                AttributePatch(tracker, "fork", _fork_without_device_rng),
                AttributePatch(tracker, "add", _add_without_device_rng),
            ]
        for patch in self._patches:
            patch.apply()
        return FixReport(FIX_NAME, "applied", "patched " + ", ".join(p.describe() for p in self._patches))

    def revert(self) -> None:
        for patch in reversed(self._patches):
            patch.revert()

    def verify(self) -> None:
        """Raise unless megatron allocates and syncs on the CPU and its RNG tracker seeds and forks there."""
        if not megatron_installed():
            return
        import torch
        from megatron.core.tensor_parallel import random as megatron_random
        from megatron.core.utils import GlobalMemoryBuffer

        buffer = GlobalMemoryBuffer().get_tensor((2,), torch.float32, "miles-hardware-probe")
        if buffer.device.type != "cpu":
            raise RuntimeError(f"megatron allocates its buffers on {buffer.device}, not on the CPU")
        torch.cuda.synchronize()

        tracker = megatron_random.CudaRNGStatesTracker()
        tracker.add("miles-hardware-probe", 1)
        with tracker.fork("miles-hardware-probe"):
            torch.rand(1)
        existing = megatron_random._CUDA_RNG_STATE_TRACKER
        if existing is not None:
            with existing.fork():
                torch.rand(1)
