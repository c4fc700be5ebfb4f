"""``miles doctor`` check for sandboxes: every provider verifies; the default one is required."""

from __future__ import annotations

from miles_core.doctor import CheckResult
from miles_core.errors import MilesError
from miles_core.plugins import MilesPluginManager
from miles_core.sandbox.activation import DEFAULT_PROVIDER, verify_contribution


def check(pm: MilesPluginManager) -> list[CheckResult]:
    """One result per provider. Failing providers fail the doctor: an installed provider that
    cannot work is a broken install, like a broken plugin. A deliberately disabled default
    provider is reported, not failed."""
    results = []
    for contribution in pm.active_contributions("sandbox"):
        plugin = contribution.plugin.name
        try:
            facts = verify_contribution(contribution, pm)
        except MilesError as exc:
            results.append(CheckResult("sandbox", contribution.name, "fail", str(exc), plugin=plugin))
            continue
        default = " (default)" if contribution.name == DEFAULT_PROVIDER else ""
        results.append(
            CheckResult("sandbox", contribution.name, "ok", f"verified{default}", plugin=plugin, data=facts)
        )
    if not any(r.item == DEFAULT_PROVIDER for r in results):
        results.append(
            CheckResult(
                "sandbox",
                DEFAULT_PROVIDER,
                "skip",
                "the default provider is not registered (core-sandbox disabled?); sandbox commands need --provider",
                required=False,
            )
        )
    return results
