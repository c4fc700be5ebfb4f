"""Choose the one hardware backend of this process.

Rules, in order:

1. ``MILES_HARDWARE=<name>`` selects that backend, whatever detection says (an unknown name is a
   :class:`~miles_core.errors.ConfigError` listing the registered ones).
2. Otherwise every backend's ``detect()`` runs. Among those that claim the machine, a plugin's
   backend beats a built-in one (miles-rocm over the built-in cpu, say).
3. Two claims left at the same level is an error naming both; so is no claim at all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from miles_core.errors import ConfigError, MilesError
from miles_core.hardware.base import ENV_OVERRIDE, Detection, HardwareBackend
from miles_core.plugins import ENV_DENY, Contribution, MilesPluginManager


class SelectionError(MilesError):
    """No backend, or more than one, can be selected for this machine."""


@dataclass(frozen=True)
class Candidate:
    contribution: Contribution
    detection: Detection

    def describe(self) -> str:
        return (
            f"{self.contribution.name!r} (plugin {self.contribution.plugin.label}): {self.detection.reason}"
        )


@dataclass(frozen=True)
class Selection:
    contribution: Contribution
    selected_by: Literal["override", "detection"]
    reason: str
    candidates: tuple[Candidate, ...]

    @property
    def backend(self) -> HardwareBackend:
        return self.contribution.obj

    @property
    def replaced(self) -> tuple[Candidate, ...]:
        """The built-in backends that claim this machine too but lost, by detection, to a plugin's."""
        if self.selected_by != "detection" or self.contribution.plugin.builtin:
            return ()
        return tuple(c for c in self.candidates if c.detection.claimed and c.contribution.plugin.builtin)


def select_backend(pm: MilesPluginManager, environ: Mapping[str, str] | None = None) -> Selection:
    """Select the backend for this process (does not apply or verify it)."""
    env = os.environ if environ is None else environ
    contributions = pm.active_contributions("hardware")
    if not contributions:
        raise SelectionError(
            "no hardware backend is registered; the built-in plugin core-hardware provides cpu and "
            f"cuda (check {ENV_DENY})"
        )
    candidates = tuple(Candidate(c, _detect(c)) for c in contributions)

    override = env.get(ENV_OVERRIDE, "").strip()
    if override:
        for candidate in candidates:
            if candidate.contribution.name == override:
                reason = f"{ENV_OVERRIDE}={override} (detection: {candidate.detection.reason})"
                return Selection(candidate.contribution, "override", reason, candidates)
        known = ", ".join(sorted(c.contribution.name for c in candidates))
        raise ConfigError(
            f"{ENV_OVERRIDE}={override!r} names no registered hardware backend (registered: {known})"
        )

    claims = [c for c in candidates if c.detection.claimed]
    from_plugins = [c for c in claims if not c.contribution.plugin.builtin]
    finalists = from_plugins or claims
    if len(finalists) > 1:
        raise SelectionError(
            "more than one hardware backend claims this machine: "
            + "; ".join(c.describe() for c in finalists)
            + f". Choose one with {ENV_OVERRIDE}=<name>, or disable a plugin with {ENV_DENY}"
        )
    if not finalists:
        raise SelectionError(
            "no hardware backend claims this machine: "
            + "; ".join(c.describe() for c in candidates)
            + f". Install the plugin for this hardware, or choose a backend with {ENV_OVERRIDE}=<name>"
        )
    chosen = finalists[0]
    reason = chosen.detection.reason
    outranked = [c.contribution.name for c in claims if c is not chosen]
    if outranked:
        reason += f" (a plugin's backend beats the built-in {', '.join(outranked)})"
    return Selection(chosen.contribution, "detection", reason, candidates)


def _detect(contribution: Contribution) -> Detection:
    try:
        detection = contribution.obj.detect()
    except Exception as exc:
        raise SelectionError(
            f"hardware backend {contribution.name!r} of plugin {contribution.plugin.label} "
            f"failed to detect this machine: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(detection, Detection):
        raise SelectionError(
            f"hardware backend {contribution.name!r} of plugin {contribution.plugin.label} "
            f"returned {detection!r} from detect(); expected a Detection"
        )
    return detection
