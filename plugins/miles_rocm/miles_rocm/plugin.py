"""Registration module of miles-rocm (entry point ``miles-rocm`` in group ``miles.plugins``).

Importing this module must stay cheap: no torch, transformers, ray, megatron or e2b at import.
"""

from typing import Any

from miles_core.hookspecs import hookimpl


@hookimpl
def miles_ci_hardware() -> list[Any]:
    from miles_rocm.ci import ROCM

    return [ROCM]
