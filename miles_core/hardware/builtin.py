"""Built-in plugin ``core-hardware``: the cpu and cuda backends.

Importing this module and calling its hook is cheap: the backends import torch in their methods.
"""

from __future__ import annotations

from miles_core.hardware.base import HardwareBackend
from miles_core.hardware.cpu import CpuBackend
from miles_core.hardware.cuda import CudaBackend
from miles_core.hookspecs import hookimpl


@hookimpl
def miles_hardware_backends() -> list[HardwareBackend]:
    return [CudaBackend(), CpuBackend()]
