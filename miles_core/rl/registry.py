"""Config settings that name plugin contributions, checked against what is installed.

``rollout.path``, ``algorithm.name``, ``trainer.backend`` and ``orchestrator.kind`` each select one
contribution of a concern; ``run.trackers`` selects several. :func:`check_config` (run by
:func:`~miles_core.rl.config.load_config`) checks, before anything is built:

* every name is installed (else: the installed names and a "did you mean");
* no setting is moved from its default when the selected object does not read it (each object
  declares the settings of its section it reads; the message names the ones that do);
* the algorithm's smallest group fits ``rollout.samples_per_prompt`` and the rollout function
  provides the rollout fields the algorithm needs;
* each tracker's options validate, and ``jsonl`` (the run's own record) is among the trackers.

:func:`resolve` is what the run calls when it activates the selected object: the same name check,
fail-closed on broken plugins of the concern, then the object's ``verify()``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from miles_core.errors import ConfigError
from miles_core.plugins import Contribution, MilesPluginManager
from miles_core.rl.algorithms.base import SHARED_SETTINGS

if TYPE_CHECKING:
    from miles_core.rl.algorithms.base import Algorithm
    from miles_core.rl.config import TrainConfig
    from miles_core.rl.orchestrators.base import Orchestrator
    from miles_core.rl.rollout.base import RolloutFunction
    from miles_core.rl.trackers.base import Tracker
    from miles_core.rl.trainers.base import TrainerBackend

#: the setting that selects one contribution -> (concern, what its objects are called)
SELECTORS: Mapping[str, tuple[str, str]] = {
    "algorithm.name": ("algorithms", "algorithm"),
    "rollout.path": ("rollout", "rollout function"),
    "trainer.backend": ("trainer", "trainer backend"),
    "orchestrator.kind": ("orchestrator", "orchestrator"),
}

#: per section, the settings every selected object honours (an object's ``settings`` adds its own;
#: ``rollout.gdn_state_dtype`` is the engine's, which every rollout function samples from)
SHARED: Mapping[str, frozenset[str]] = {
    "algorithm": SHARED_SETTINGS,
    "rollout": frozenset(
        {"path", "prompts_per_step", "samples_per_prompt", "max_new_tokens", "temperature", "top_p", "top_k",
         "gdn_state_dtype"}
    ),
    "trainer": frozenset({"backend", "device", "max_tokens_per_row", "packing"}),
    "orchestrator": frozenset({"kind"}),
}

#: the tracker every run writes: resume, summary.json and plot.png read metrics.jsonl back
RUN_RECORD = "jsonl"


class NotInstalled(ConfigError):
    """An optional framework the object needs is not installed (``verify()`` or ``open()`` raise
    it). Not a defect of the plugin: ``miles doctor`` reports it as optional, and a run that
    selects the object stops with the install hint."""


def require_module(module: str, extra: str) -> None:
    """Raise :class:`NotInstalled` unless ``module`` is importable (``extra``: the pip extra)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        found = False
    if not found:
        raise NotInstalled(f"{module} is not installed: pip install 'miles[{extra}]'")


def did_you_mean(name: str, installed: Sequence[str]) -> str:
    """`` (installed: a, b); did you mean 'a'?`` for error messages: the closest installed name by
    edit distance (a swap of neighbours counts one edit), if it is within a third of the name."""
    text = f" (installed: {', '.join(sorted(installed)) or 'none'})"
    scored = sorted(
        (_edits(name.lower(), c.lower()), -difflib.SequenceMatcher(None, name, c).ratio(), c) for c in installed
    )
    if scored and scored[0][0] <= max(1, len(name) // 3):
        return text + f"; did you mean {scored[0][2]!r}?"
    return text


def _edits(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(rows[i - 1][j] + 1, row[j - 1] + 1, rows[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[i - 2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def lookup(pm: MilesPluginManager, concern: str, name: str, setting: str, noun: str) -> Contribution:
    """The contribution ``name`` of ``concern`` (no activation), or a ConfigError naming ``setting``."""
    contributions = pm.contributions(concern)
    for contribution in contributions:
        if contribution.name == name:
            return contribution
    message = f"{setting}: unknown {noun} {name!r}" + did_you_mean(name, [c.name for c in contributions])
    broken = [record.label for record, _ in pm.broken_for(concern)]
    if broken:
        message += f"; broken plugin(s) that may have provided it: {', '.join(broken)} (see `miles plugins list`)"
    raise ConfigError(message)


def resolve(pm: MilesPluginManager, concern: str, name: str, setting: str, noun: str) -> Contribution:
    """Activate ``name``: the name check, fail closed on the concern's broken plugins, ``verify()``
    (a failure is recorded against the plugin and raised with its provenance; a missing optional
    framework is raised as :class:`NotInstalled`, naming the setting)."""
    lookup(pm, concern, name, setting, noun)
    contribution = pm.contribution(concern, name)  # raises if a plugin of the concern is broken
    missing = verify_allowing_missing(pm, contribution)
    if missing is not None:
        raise NotInstalled(f"{setting} = {name!r}: {missing}")
    return contribution


def verify_allowing_missing(pm: MilesPluginManager, contribution: Contribution) -> NotInstalled | None:
    """Run the contribution's ``verify()`` through ``pm.verify`` (a failure is recorded against
    its plugin and raised with provenance); a missing optional framework is returned instead."""
    missing: list[NotInstalled] = []

    def check() -> None:
        try:
            contribution.obj.verify()
        except NotInstalled as exc:  # not a defect of the plugin: nothing to record
            missing.append(exc)

    pm.verify(contribution, check)
    return missing[0] if missing else None


def algorithm(pm: MilesPluginManager, config: TrainConfig) -> Algorithm:
    """The verified algorithm ``algorithm.name`` selects."""
    obj: Algorithm = resolve(pm, "algorithms", config.algorithm.name, "algorithm.name", "algorithm").obj
    return obj


def rollout_function(pm: MilesPluginManager, config: TrainConfig) -> RolloutFunction:
    """The verified rollout function ``rollout.path`` selects."""
    obj: RolloutFunction = resolve(pm, "rollout", config.rollout.path, "rollout.path", "rollout function").obj
    return obj


def trainer_backend(pm: MilesPluginManager, config: TrainConfig) -> TrainerBackend:
    """The verified trainer backend ``trainer.backend`` selects."""
    obj: TrainerBackend = resolve(pm, "trainer", config.trainer.backend, "trainer.backend", "trainer backend").obj
    return obj


def orchestrator(pm: MilesPluginManager, config: TrainConfig) -> Orchestrator:
    """The verified orchestrator ``orchestrator.kind`` selects."""
    obj: Orchestrator = resolve(pm, "orchestrator", config.orchestrator.kind, "orchestrator.kind", "orchestrator").obj
    return obj


def trackers(pm: MilesPluginManager, config: TrainConfig) -> list[Tracker]:
    """The verified trackers ``run.trackers`` selects, in its order."""
    return [resolve(pm, "trackers", name, "run.trackers", "tracker").obj for name in config.run.trackers]


def algorithm_defaults(pm: MilesPluginManager, data: Mapping[str, Any]) -> dict[str, Any]:
    """The selected algorithm's own defaults (empty if the name is unknown: check_config says so)."""
    name = (data.get("algorithm") or {}).get("name", "grpo")
    for contribution in pm.contributions("algorithms"):
        if contribution.name == name:
            return dict(getattr(contribution.obj, "defaults", {}) or {})
    return {}


def check_config(config: TrainConfig, pm: MilesPluginManager, source: str = "config") -> None:
    """Every rule that depends on the installed plugins (see the module doc); one ConfigError
    listing every problem, in the format of :func:`~miles_core.rl.config.format_validation_error`."""
    problems: list[str] = []
    selected: dict[str, Any] = {}
    for setting, (concern, noun) in SELECTORS.items():
        section, key = setting.split(".")
        try:
            selected[section] = lookup(pm, concern, getattr(getattr(config, section), key), setting, noun).obj
        except ConfigError as exc:
            problems.append(str(exc))
    for section, obj in selected.items():
        problems += _unused_settings(config, pm, section, obj)
    algorithm: Algorithm | None = selected.get("algorithm")
    rollout = selected.get("rollout")
    if algorithm is not None:
        smallest = int(getattr(algorithm, "min_group_size", 1))
        if config.rollout.samples_per_prompt < smallest:
            problems.append(
                f"rollout.samples_per_prompt must be >= {smallest} for {algorithm.name} "
                f"(a group needs {smallest} samples; got {config.rollout.samples_per_prompt})"
            )
    if algorithm is not None and rollout is not None:
        missing = sorted(set(algorithm.needs) - set(rollout.provides))
        if missing:
            problems.append(
                f"algorithm.name: {algorithm.name!r} needs rollout field(s) {', '.join(missing)}, which "
                f"rollout.path {rollout.name!r} does not provide"
            )
    problems += _check_trackers(config, pm)
    if problems:
        raise ConfigError(f"invalid training config ({source}): " + "; ".join(problems))


def _unused_settings(config: TrainConfig, pm: MilesPluginManager, section: str, obj: Any) -> list[str]:
    """Settings of ``section`` moved from their default that the selected ``obj`` does not read."""
    selector = next(s for s in SELECTORS if s.startswith(section + "."))
    concern = SELECTORS[selector][0]
    values: BaseModel = getattr(config, section)
    reads = SHARED[section] | frozenset(getattr(obj, "settings", ()))
    problems = []
    for key, field in type(values).model_fields.items():
        value, default = getattr(values, key), field.default
        if key in reads or value == default:
            continue
        readers = sorted(c.name for c in pm.contributions(concern) if key in getattr(c.obj, "settings", ()))
        change = _change(f"{section}.{key}", value, default)
        current = f"({selector} {obj.name!r} does not use it)"
        if len(readers) == 1:
            problems.append(f"{change} needs {selector} = {readers[0]!r} {current}")
        elif readers:
            problems.append(f"{change} needs {selector} in {readers} {current}")
        else:
            problems.append(f"{change}: no installed {section} uses it {current}")
    return problems


def _change(setting: str, value: Any, default: Any) -> str:
    """How a moved setting reads in a message: ``trainer.world_size > 1``, ``trainer.compile``."""
    if default is None:
        return f"{setting} is set:"
    if isinstance(default, bool) or default == 0:
        return setting
    if isinstance(default, int) and isinstance(value, int) and value > default:
        return f"{setting} > {default}"
    return f"{setting} = {value!r}"


def _check_trackers(config: TrainConfig, pm: MilesPluginManager) -> list[str]:
    problems = []
    names = list(config.run.trackers)
    if RUN_RECORD not in names:
        problems.append(
            f"run.trackers must include {RUN_RECORD!r}: metrics.jsonl is the run's own record "
            f"(resume, summary.json and plot.png read it back); got {names}"
        )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"run.trackers lists {', '.join(duplicates)} more than once")
    trackers = {}
    for name in dict.fromkeys(names):
        try:
            trackers[name] = lookup(pm, "trackers", name, "run.trackers", "tracker").obj
        except ConfigError as exc:
            problems.append(str(exc))
    for name, options in config.run.tracker_options.items():
        if name not in names:
            problems.append(f"run.tracker_options.{name} is set but run.trackers does not include {name!r}")
        elif name in trackers:
            problems += _check_options(trackers[name], name, options)
    return problems


def _check_options(tracker: Any, name: str, options: Mapping[str, Any]) -> list[str]:
    schema: type[BaseModel] = tracker.options
    try:
        schema.model_validate(dict(options))
    except ValidationError as exc:
        return [
            f"run.tracker_options.{name}.{'.'.join(str(p) for p in err['loc'])}: "
            + ("unknown option" if err["type"] == "extra_forbidden" else err["msg"])
            for err in exc.errors()
        ]
    return []
