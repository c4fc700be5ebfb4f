"""``miles doctor``'s hardware check: the selected backend, why (and which built-in it replaced),
its fixes and worker env."""

from __future__ import annotations

from miles_core.doctor import CheckResult
from miles_core.errors import MilesError
from miles_core.hardware.activation import activate
from miles_core.hardware.base import ENV_OVERRIDE, LIBRARIES
from miles_core.plugins import ENV_DENY, MilesPluginManager

CONCERN = "hardware"


def check(pm: MilesPluginManager) -> list[CheckResult]:
    try:
        if not pm.active_contributions(CONCERN):
            detail = f"no hardware backend is registered (core-hardware disabled by {ENV_DENY}?)"
            return [CheckResult(CONCERN, "backend", "skip", detail, required=False)]
        hardware = activate(pm)
    except MilesError as exc:
        return [CheckResult(CONCERN, "backend", "fail", str(exc))]
    selection = hardware.selection
    plugin = selection.contribution.plugin.name
    unprepared = []
    for library in LIBRARIES:  # doctor checks every library's fixes, as a job using it would
        try:
            hardware.prepare(library)
        except MilesError as exc:
            unprepared.append(CheckResult(CONCERN, f"prepare {library}", "fail", str(exc), plugin=plugin))
    results = [
        CheckResult(
            CONCERN,
            "backend",
            "ok",
            f"{hardware.name} selected by {selection.selected_by}: {selection.reason}",
            plugin=plugin,
            data=hardware.to_dict(),
        )
    ]
    if selection.replaced:
        owner = selection.contribution.plugin
        builtins = ", ".join(repr(c.contribution.name) for c in selection.replaced)
        detail = (
            f"{hardware.name!r} of plugin {owner.label} replaces the built-in {builtins}, which also "
            f"claims this machine (a plugin's backend beats a built-in). "
            f"{ENV_OVERRIDE}={selection.replaced[0].contribution.name} selects the built-in; "
            f"{ENV_DENY}={pm.selector(owner)} removes the plugin"
        )
        results.append(CheckResult(CONCERN, "replaces built-in", "warn", detail, required=False, plugin=plugin,
                                   data={"replaced": [c.contribution.name for c in selection.replaced]}))
    results += unprepared
    for fix in hardware.all_fixes():
        results.append(
            CheckResult(
                CONCERN,
                fix.name,
                "ok",
                f"{fix.status}: {fix.detail}",
                plugin=plugin,
                data={"status": fix.status},
            )
        )
    results.append(_ci_hardware(pm, hardware.backend.ci_hardware, plugin))
    for candidate in selection.candidates:
        verdict = "claims this machine" if candidate.detection.claimed else "declines"
        results.append(
            CheckResult(
                CONCERN,
                f"candidate {candidate.contribution.name}",
                "info",
                f"{verdict}: {candidate.detection.reason}",
                required=False,
                plugin=candidate.contribution.plugin.name,
            )
        )
    return results


def _ci_hardware(pm: MilesPluginManager, name: str, plugin: str) -> CheckResult:
    """The CI hardware kind that tests this backend (optional: running does not need it)."""
    kinds = {c.name: c.obj for c in pm.contributions("ci")}
    if name not in kinds:
        detail = (
            f"no CI hardware kind named {name!r} is registered, so tests for this backend cannot be scheduled"
        )
        return CheckResult(CONCERN, "ci-hardware", "fail", detail, required=False, plugin=plugin)
    marker = getattr(kinds[name], "marker", "?")
    return CheckResult(
        CONCERN, "ci-hardware", "ok", f"{name} (marker {marker})", required=False, plugin=plugin
    )
