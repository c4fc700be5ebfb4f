"""Model patches: the protocol, the per-forward packing context, and ``prepare_model``.

``from miles_core.patches import prepare_model`` is cheap; torch is imported when it is called.
See docs/patches.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_core.patches.base import (
    AppliedPatch,
    KernelRequirement,
    ModelPatch,
    PatchError,
    PatchVerificationError,
    ProbeResult,
)

if TYPE_CHECKING:
    from miles_core.patches.report import PatchReport, PrepareReport
    from miles_core.plugins import MilesPluginManager

__all__ = [
    "AppliedPatch",
    "KernelRequirement",
    "ModelPatch",
    "PatchError",
    "PatchReport",
    "PatchVerificationError",
    "PrepareReport",
    "ProbeResult",
    "prepare_model",
]


def prepare_model(
    model: Any, *, pm: MilesPluginManager | None = None, probe: bool = True, packed: bool = False
) -> PrepareReport:
    """Apply, verify and probe every matching patch on ``model``; see :mod:`miles_core.patches.prepare`."""
    from miles_core.patches.prepare import prepare_model as _prepare_model

    return _prepare_model(model, pm=pm, probe=probe, packed=packed)


def __getattr__(name: str) -> Any:
    # the report types are only needed once a model is prepared; keep plugin discovery light
    if name in ("PatchReport", "PrepareReport"):
        from miles_core.patches import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
