"""Registration module of miles-rocm (entry point ``miles-rocm`` in group ``miles.plugins``).

Importing this module must stay cheap: no torch, transformers, ray, megatron or e2b at import.
"""

from __future__ import annotations

from typing import Any

from miles_core.hardware.base import HardwareBackend
from miles_core.hookspecs import hookimpl
from miles_rocm.backend import RocmBackend


@hookimpl
def miles_hardware_backends() -> list[HardwareBackend]:
    return [RocmBackend()]


@hookimpl
def miles_ci_hardware() -> list[Any]:
    from miles_rocm.ci import ROCM

    return [ROCM]
