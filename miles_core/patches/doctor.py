"""``miles doctor`` for model patches: environment, kernels, and each patch proven on example models.

Per patch: its ``check_environment()`` (a problem fails the doctor and breaks the plugin), the state
of every kernel it declares, and -- when the patch offers ``example_models()`` (name -> factory of a
tiny model) -- :func:`~miles_core.patches.prepare_model` on each of them: applied, verified on the
built model and probed, exactly as a training job would.
"""

from __future__ import annotations

from miles_core.doctor import CheckResult
from miles_core.errors import MilesError
from miles_core.plugins import MilesPluginManager


def check(pm: MilesPluginManager) -> list[CheckResult]:
    from miles_core.patches.prepare import prepare_model

    results: list[CheckResult] = []
    for contribution in pm.active_contributions("patches"):
        patch, plugin = contribution.obj, contribution.plugin.name
        problems = patch.check_environment()
        results.append(
            CheckResult(
                "patches",
                f"{contribution.name}: environment",
                "fail" if problems else "ok",
                "; ".join(problems) or "every architecture it must cover can be patched",
                plugin=plugin,
            )
        )
        for req in patch.requires:
            state, detail = req.state()
            results.append(
                CheckResult(
                    "patches",
                    f"{contribution.name}: kernel {req.module}",
                    "ok" if state == "available" else ("fail" if req.required else "info"),
                    f"{detail} (used on {', '.join(req.device_types)} for {req.purpose})",
                    required=req.required,
                    plugin=plugin,
                )
            )
        if problems:
            continue
        for name, factory in getattr(patch, "example_models", dict)().items():
            item = f"{contribution.name}: {name}"
            try:
                prepared = prepare_model(factory(), pm=pm, probe=True)
            except MilesError as exc:  # reported as this item's failure, with the cause
                results.append(CheckResult("patches", item, "fail", str(exc), plugin=plugin))
                continue
            if contribution.name not in prepared:
                results.append(CheckResult(
                    "patches", item, "fail",
                    f"the patch does not apply to its own example model {prepared.model} "
                    f"(matches() declined it and it holds none of the patch's targets)", plugin=plugin))
                continue
            applied = prepared[contribution.name]
            if applied.probe is None:
                raise RuntimeError(f"prepare_model(probe=True) returned no probe result for {contribution.name}")
            results.append(
                CheckResult(
                    "patches",
                    item,
                    "ok",
                    f"patched {', '.join(applied.classes)}; probe max |diff| "
                    f"{applied.probe.max_abs_diff:.2g} <= {applied.probe.tolerance:.2g}",
                    plugin=plugin,
                    data={"groups": {k: list(v) for k, v in applied.groups.items()}},
                )
            )
    return results
