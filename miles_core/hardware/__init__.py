"""Hardware backends: one explicit concern for everything that differs between platforms.

Public API::

    from miles_core.hardware import activate

    hw = activate()                  # select -> apply fixes -> verify, once per process
    hw.device                        # torch.device to compute on
    hw.distributed_backend           # "gloo", "nccl", ...
    hw.worker_env("train")           # env vars for a Ray worker
    hw.supports("mm_out_dtype_fp32") # ask about capabilities, never about platforms

Backends implement :class:`miles_core.hardware.base.HardwareBackend`; selection rules are in
:mod:`miles_core.hardware.selection`. Importing this package does not import torch, and the names
below load their module on first use, so plugin discovery (which imports ``...hardware.base``)
does not pay for activation code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ActiveHardware": "activation",
    "activate": "activation",
    "reset": "activation",
    "CAPABILITIES": "base",
    "ENV_OVERRIDE": "base",
    "WORKER_ROLES": "base",
    "CheckpointIOPolicy": "base",
    "Detection": "base",
    "FixReport": "base",
    "HardwareBackend": "base",
    "Selection": "selection",
    "SelectionError": "selection",
    "select_backend": "selection",
}

__all__ = [
    "CAPABILITIES",
    "ENV_OVERRIDE",
    "WORKER_ROLES",
    "ActiveHardware",
    "CheckpointIOPolicy",
    "Detection",
    "FixReport",
    "HardwareBackend",
    "Selection",
    "SelectionError",
    "activate",
    "reset",
    "select_backend",
]

if TYPE_CHECKING:
    from miles_core.hardware.activation import ActiveHardware, activate, reset
    from miles_core.hardware.base import (
        CAPABILITIES,
        ENV_OVERRIDE,
        WORKER_ROLES,
        CheckpointIOPolicy,
        Detection,
        FixReport,
        HardwareBackend,
    )
    from miles_core.hardware.selection import Selection, SelectionError, select_backend


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
