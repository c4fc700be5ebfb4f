"""``miles doctor`` checks of the training concern: every task, algorithm, rollout function,
trainer backend, orchestrator and tracker is verified (each ``verify()`` checks its effect: the
algorithm's loss on the probe batch, one update of each trainer on a tiny model, a tracker's
records read back from its store), the presets validate, and the trainer's dependencies import.

A missing optional framework (megatron-core, Ray, a tracker SDK) is reported, not required; any
other verification failure fails the doctor and names the plugin.
"""

from __future__ import annotations

import importlib.util

from miles_core.doctor import CheckResult
from miles_core.errors import ConfigError
from miles_core.plugins import Contribution, MilesPluginManager

REQUIRED_MODULES = ("transformers", "safetensors", "matplotlib")
OPTIONAL_MODULES = {"ray": "--orchestrator ray", "megatron.core": "trainer.backend = megatron"}

#: concern -> the word the report uses for its objects
STEP_CONCERNS = {
    "algorithms": "algorithm",
    "rollout": "rollout",
    "trainer": "trainer",
    "orchestrator": "orchestrator",
    "trackers": "tracker",
}


def check(pm: MilesPluginManager) -> list[CheckResult]:
    results = _tasks(pm)
    for concern, noun in STEP_CONCERNS.items():
        # broken plugins are reported (and fail the doctor) under "plugins"; verify the rest
        for contribution in pm.contributions(concern):
            results.append(_verified(pm, contribution, noun))
    results += _presets(pm)
    for module in REQUIRED_MODULES:
        found = importlib.util.find_spec(module) is not None
        results.append(CheckResult("train", f"module {module}", "ok" if found else "fail",
                                   "importable" if found else "missing: pip install 'miles[train]'"))
    for module, needed_for in OPTIONAL_MODULES.items():
        found = _has(module)
        results.append(CheckResult("train", f"module {module}", "ok" if found else "info",
                                   ("importable" if found else "not installed") + f" (needed for {needed_for})",
                                   required=False))
    return results


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def _tasks(pm: MilesPluginManager) -> list[CheckResult]:
    from miles_core.rl.tasks import trainable

    results = []
    for contribution in pm.contributions("tasks"):
        task = contribution.obj
        pm.verify(contribution, task.verify)
        plugin = contribution.plugin.name
        try:
            ready = trainable(task)
        except ConfigError as exc:  # verified, but `miles train` cannot use it
            results.append(CheckResult("train", f"task {task.name}", "info", f"verified; {exc}",
                                       required=False, plugin=plugin))
            continue
        results.append(CheckResult("train", f"task {task.name}", "ok",
                                   f"{len(ready.prompts)} prompts; {ready.description}", plugin=plugin))
    return results


def _verified(pm: MilesPluginManager, contribution: Contribution, noun: str) -> CheckResult:
    from miles_core.rl.registry import verify_allowing_missing

    item, plugin = f"{noun} {contribution.name}", contribution.plugin.name
    description = str(getattr(contribution.obj, "description", ""))
    try:
        missing = verify_allowing_missing(pm, contribution)
    except Exception as exc:  # recorded against the plugin by pm.verify
        return CheckResult("train", item, "fail", str(exc), plugin=plugin)
    if missing is not None:
        return CheckResult("train", item, "info", f"not usable here: {missing}", required=False, plugin=plugin)
    return CheckResult("train", item, "ok", f"verified; {description}", plugin=plugin)


def _presets(pm: MilesPluginManager) -> list[CheckResult]:
    """Each preset validates against the installed plugins; a preset whose objects no installed
    plugin provides (the core's built-ins disabled, say) is reported, not required."""
    from miles_core.rl.config import PRESETS, load_config
    from miles_core.rl.registry import SELECTORS

    results = []
    empty = [setting for setting, (concern, _) in SELECTORS.items() if not pm.contributions(concern)]
    for name in PRESETS:
        try:
            config = load_config(name, pm=pm)
        except ConfigError as exc:
            if empty:
                results.append(CheckResult("train", f"preset {name}", "info",
                                           f"nothing installed provides {', '.join(empty)}: {exc}", required=False))
            else:
                results.append(CheckResult("train", f"preset {name}", "fail", str(exc)))
            continue
        results.append(CheckResult("train", f"preset {name}", "ok",
                                   f"model {config.model.preset or config.model.path} ({config.model.dtype}), "
                                   f"{config.algorithm.name}, {config.rollout.path} rollouts, "
                                   f"{config.trainer.backend} trainer"))
    return results
