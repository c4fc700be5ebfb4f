"""Registration module of miles-qwen35 (entry point ``miles-qwen35`` in group ``miles.plugins``).

Importing this module must stay cheap: no torch, transformers, ray, megatron or e2b at import.
"""

from __future__ import annotations

from miles_core.hookspecs import hookimpl
from miles_qwen35.patch import GatedDeltaNetPackingPatch


@hookimpl
def miles_model_patches() -> list[GatedDeltaNetPackingPatch]:
    return [GatedDeltaNetPackingPatch()]
