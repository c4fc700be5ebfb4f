"""``miles doctor`` checks for the engine concern: every engine kind verifies on this machine.

The embedded engine is required (``miles train`` falls back to it); other kinds are reported.
"""

from __future__ import annotations

from miles_core.doctor import CheckResult
from miles_core.errors import ActivationError
from miles_core.plugins import MilesPluginManager


def check(pm: MilesPluginManager) -> list[CheckResult]:
    results = []
    for contribution in pm.active_contributions("engine"):
        required = contribution.name == "embedded"
        try:
            data = pm.verify(contribution, contribution.obj.verify)
        except ActivationError as exc:
            results.append(CheckResult("engine", contribution.name, "fail", str(exc), required, contribution.plugin.name))
            continue
        detail = ", ".join(f"{k}={v}" for k, v in sorted((data or {}).items()))
        results.append(CheckResult("engine", contribution.name, "ok", detail, required, contribution.plugin.name, dict(data or {})))
    return results
