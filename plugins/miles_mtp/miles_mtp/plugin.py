"""Registration module of miles-mtp (entry point ``miles-mtp`` in group ``miles.plugins``).

Importing this module must stay cheap: no torch, transformers, ray, megatron or e2b at import.
"""

from __future__ import annotations

from miles_core.hookspecs import hookimpl
from miles_mtp.patch import MTPLabelPatch


@hookimpl
def miles_model_patches() -> list[MTPLabelPatch]:
    """The MTP label contract for megatron-core model paths (see miles_mtp.patch)."""
    return [MTPLabelPatch()]
