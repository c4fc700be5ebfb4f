"""``miles doctor``'s hardware check: the selected backend, why, its fixes and worker env."""

from __future__ import annotations

from miles_core.doctor import CheckResult
from miles_core.errors import MilesError
from miles_core.hardware.activation import activate
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
    for fix in hardware.fixes:
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
