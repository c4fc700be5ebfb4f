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

    results = []
    for contribution in pm.active_contributions("tasks"):
        task = contribution.obj
        pm.verify(contribution, task.verify)
        results.append(CheckResult("train", f"task {task.name}", "ok", f"{len(task.prompts())} prompts; {task.description}",
                                   plugin=contribution.plugin.name))
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
