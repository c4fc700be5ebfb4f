"""``miles doctor`` check for the CI concern: every installed CI hardware kind verifies (its marker
is a runtime no-op ``miles ci`` can parse, its default suites fit it). A project's suites and
registrations are checked by ``miles ci list``, which needs a tree."""

from __future__ import annotations

from miles_core.doctor import CheckResult
from miles_core.plugins import MilesPluginManager


def check(pm: MilesPluginManager) -> list[CheckResult]:
    results = []
    for contribution in pm.active_contributions("ci"):
        kind = contribution.obj
        pm.verify(contribution, kind.verify)
        detail = f"marker {kind.marker_name}; retries {', '.join(sorted(kind.retriable)) or 'nothing'}"
        results.append(CheckResult("ci", kind.name, "ok", detail, plugin=contribution.plugin.name))
    return results
