"""``miles doctor`` checks of the training concern: tasks verify, presets validate, the trainer's
dependencies import (Ray and megatron-core are optional: reported, not required)."""

from __future__ import annotations

import importlib.util
from typing import Any

from miles_core.doctor import CheckResult

REQUIRED_MODULES = ("transformers", "safetensors", "matplotlib", "aiohttp")
OPTIONAL_MODULES = {"ray": "--orchestrator ray", "megatron.core": "trainer.backend = megatron"}


def check(pm: Any) -> list[CheckResult]:
    from miles_core.rl.config import PRESETS, load_config
    from miles_core.rl.tasks import Task

    results = []
    # broken task plugins are reported (and fail the doctor) under "plugins"; check the rest
    for contribution in pm.contributions("tasks"):
        task = contribution.obj
        pm.verify(contribution, task.verify)
        plugin = contribution.plugin.name
        if isinstance(task, Task):
            results.append(CheckResult("train", f"task {task.name}", "ok",
                                       f"{len(task.prompts())} prompts; {task.description}", plugin=plugin))
        else:  # verified, but `miles train` cannot use it
            missing = [a for a in ("description", "reward", "has_accuracy", "tools", "prompts") if not hasattr(task, a)]
            results.append(CheckResult("train", f"task {task.name}", "info",
                                       f"verified; not trainable: lacks {', '.join(missing)} (miles_core.rl.tasks.Task)",
                                       required=False, plugin=plugin))
    for name in PRESETS:
        config = load_config(name)
        results.append(CheckResult("train", f"preset {name}", "ok",
                                   f"model {config.model.preset or config.model.path} ({config.model.dtype}), "
                                   f"{config.rollout.path} rollouts, {config.trainer.backend} trainer"))
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
