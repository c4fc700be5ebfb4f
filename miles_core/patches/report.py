"""What :func:`miles_core.patches.prepare_model` returns: each patch and the classes it patched."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from miles_core.patches.base import ProbeResult


@dataclass(frozen=True)
class PatchReport:
    """One patch applied to one model, with its provenance and evidence."""

    name: str
    plugin: str
    distribution: str | None
    version: str | None
    classes: tuple[str, ...]
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    kernels: Mapping[str, str] = field(default_factory=dict)
    probe: ProbeResult | None = None
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True)
class PrepareReport:
    """Every patch applied and verified on a model, and the patches that did not match it."""

    model: str
    patches: tuple[PatchReport, ...]
    not_matched: tuple[str, ...]
    packing_scope: bool
    #: full-attention layers attend per document in packed forwards (no dense block-diagonal mask)
    packed_attention: bool = False

    @property
    def applied(self) -> dict[str, list[str]]:
        """Patch name -> classes it patched."""
        return {p.name: list(p.classes) for p in self.patches}

    def __getitem__(self, name: str) -> PatchReport:
        for patch in self.patches:
            if patch.name == name:
                return patch
        raise KeyError(f"no patch {name!r} was applied to {self.model} (applied: {list(self.applied)})")

    def __contains__(self, name: object) -> bool:
        return any(p.name == name for p in self.patches)

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


def _plain(report: PatchReport | PrepareReport) -> dict[str, Any]:
    """Nested dicts, lists and scalars: what the report looks like as JSON."""
    return json.loads(json.dumps(asdict(report)))
