"""Everything ``miles ci`` knows about a tree: hardware kinds, suites, labels and registrations,
cross-checked. :func:`load_catalog` is the only entry point; it either returns a fully valid
catalog or raises, listing every problem with its ``file:line``.

Exit codes follow from the errors raised: :class:`~miles_core.errors.ConfigError` (a bad suites
file or registration) exits 2; :class:`~miles_core.errors.ActivationError` (a hardware kind that
fails its own verification) exits 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

from miles_core.ci.base import CIHardware, HardwareSettings, Suite
from miles_core.ci.config import CIConfig, closest, joined, load_config, settings_for
from miles_core.ci.discovery import GPU_COUNT_NAME, Marker, Registration, discover, find_test_files
from miles_core.ci.layout import ParallelLayout
from miles_core.errors import ConfigError
from miles_core.plugins import Contribution, MilesPluginManager, get_plugin_manager

#: ``stage-c-4-gpu-mi350``: a suite name that states a GPU count must mean it
SUITE_GPUS_RE = re.compile(r"(?:^|-)(\d+)-gpus?(?:-|$)")


@dataclass(frozen=True)
class CatalogWarning:
    """Something that wastes or hides work without being wrong: ``suite`` is None when it is
    about the whole tree."""

    suite: str | None
    message: str


@dataclass(frozen=True)
class Catalog:
    config: CIConfig
    kinds: dict[str, CIHardware]
    providers: dict[str, str]  # hardware name -> plugin that contributes it
    suites: dict[str, Suite]
    labels: dict[str, str]
    files: tuple[str, ...]
    registrations: tuple[Registration, ...]
    warnings: tuple[CatalogWarning, ...] = ()

    @property
    def root(self) -> Path:
        return self.config.root

    def kind(self, name: str) -> CIHardware:
        if name not in self.kinds:
            raise ConfigError(f"unknown hardware {name!r}" + closest(name, list(self.kinds)))
        return self.kinds[name]

    def suite(self, name: str, hardware: str | None = None) -> Suite:
        """The suite ``name``; with ``hardware``, it must run on that hardware."""
        if hardware is not None:
            self.kind(hardware)
        if name not in self.suites:
            candidates = [s.name for s in self.suites.values() if hardware in (None, s.hardware)]
            raise ConfigError(f"unknown suite {name!r}" + closest(name, candidates or list(self.suites)))
        suite = self.suites[name]
        if hardware is not None and suite.hardware != hardware:
            raise ConfigError(f"suite {name!r} runs on {suite.hardware}, not {hardware}")
        return suite

    def settings(self, hardware: str) -> HardwareSettings:
        return settings_for(self.config, self.kind(hardware).default_settings, hardware)

    def in_suite(self, suite: str) -> list[Registration]:
        return [r for r in self.registrations if r.suite == suite]

    def runnable(self, suite: str) -> list[Registration]:
        """The registrations of ``suite`` that can run at all: enabled, in an enabled stage."""
        return [r for r in self.in_suite(suite) if r.enabled] if self.suites[suite].enabled else []

    def shards(self, suite: str) -> int:
        """Shards a stage really runs: its configured count, but never more than it has files
        (0 for a stage with nothing to run, which gets no job)."""
        return min(self.suites[suite].shards, len(self.runnable(suite)))

    def warnings_for(self, suite: str | None) -> list[str]:
        return [w.message for w in self.warnings if suite is None or w.suite in (None, suite)]


def load_catalog(
    root: Path, config_path: Path | None = None, pm: MilesPluginManager | None = None
) -> Catalog:
    """Load the suites file, activate the CI hardware kinds and discover registrations."""
    config = load_config(root, config_path)
    pm = pm or get_plugin_manager()
    kinds, providers = _activate_kinds(pm)
    problems: list[str] = []
    for name in config.hardware:
        if name not in kinds:
            problems.append(
                f"{config.hardware_sources[name]}: unknown hardware {name!r}" + closest(name, list(kinds))
            )
    labels = {label: text for kind in kinds.values() for label, text in kind.labels.items()} | config.labels
    suites = (
        config.suites
        if config.suites is not None
        else tuple(s for k in kinds.values() for s in k.default_suites)
    )
    problems.extend(_suite_problems(suites, kinds, labels))
    markers = {
        kind.marker_name: Marker(kind.marker_name, kind.name, kind.marker_parameters())
        for kind in kinds.values()
    }
    files = find_test_files(config.root, config.paths, config.patterns)
    registrations, parse_problems = discover(config.root, files, markers)
    problems.extend(parse_problems)
    by_name = {s.name: s for s in suites}
    for reg in registrations:
        problems.extend(
            f"{reg.location}: {p}" for p in _registration_problems(reg, kinds[reg.hardware], by_name, labels)
        )
    untracked = [f"stage {s.name} ({s.source})" for s in suites if s.disabled and not s.issue] + [
        r.location for r in registrations if r.disabled and not r.issue
    ]
    if config.disabled_needs_issue:
        problems.extend(
            f"{where}: disabled without issue= (disabled-needs-issue = true: name the tracking issue)"
            for where in untracked
        )
    if problems:
        raise ConfigError(joined(problems))
    catalog = Catalog(
        config=config,
        kinds=kinds,
        providers=providers,
        suites=by_name,
        labels=labels,
        files=tuple(files),
        registrations=tuple(registrations),
    )
    notes = [CatalogWarning(*w) for w in _shard_warnings(catalog)]
    if untracked:
        notes.append(
            CatalogWarning(
                None,
                f"{len(untracked)} disabled entr{'y has' if len(untracked) == 1 else 'ies have'} no tracking "
                f"issue (add issue=...): {', '.join(untracked)}",
            )
        )
    return replace(catalog, warnings=tuple(notes))


def _shard_warnings(catalog: Catalog) -> list[tuple[str, str]]:
    out = []
    for suite in catalog.suites.values():
        if not suite.enabled:
            continue
        files = len(catalog.runnable(suite.name))
        if files == 0:
            out.append(
                (suite.name, f"suite {suite.name} has no enabled test files: no job is generated for it")
            )
        elif files < suite.shards:
            out.append(
                (
                    suite.name,
                    f"suite {suite.name} declares shards = {suite.shards} but has {files} enabled file(s): "
                    f"{files} shard(s) run (set shards = {files} in {suite.source or 'the suites file'})",
                )
            )
    return out


def _activate_kinds(pm: MilesPluginManager) -> tuple[dict[str, CIHardware], dict[str, str]]:
    kinds: dict[str, CIHardware] = {}
    providers: dict[str, str] = {}
    marker_owner: dict[str, str] = {}
    for contribution in pm.active_contributions("ci"):
        kind = pm.verify(contribution, _verified, contribution)
        if kind.marker_name in marker_owner:
            raise ConfigError(
                f"marker {kind.marker_name} is provided by hardware {marker_owner[kind.marker_name]!r} "
                f"and {kind.name!r} (plugin {contribution.plugin.name!r})"
            )
        marker_owner[kind.marker_name] = kind.name
        kinds[kind.name] = kind
        providers[kind.name] = contribution.plugin.name
    return kinds, providers


def _verified(contribution: Contribution) -> CIHardware:
    kind = contribution.obj
    if not isinstance(kind, CIHardware):
        raise TypeError(f"{type(kind).__name__} is not a miles_core.ci.base.CIHardware")
    kind.verify()
    return kind


def _suite_problems(
    suites: tuple[Suite, ...], kinds: dict[str, CIHardware], labels: dict[str, str]
) -> list[str]:
    problems: list[str] = []
    names = [s.name for s in suites]
    enabled = {s.name for s in suites if s.enabled}
    for suite in suites:
        where = f"{suite.source}: suite {suite.name}"
        if len(suite.runs_on) == 0:
            problems.append(f"{where}: runs-on must name at least one runner label")
        kind = kinds.get(suite.hardware)
        if kind is None:
            problems.append(
                f"{where}: unknown hardware {suite.hardware!r}" + closest(suite.hardware, list(kinds))
            )
        else:
            problems.extend(f"{where}: {p}" for p in kind.check_suite(suite))
            named = SUITE_GPUS_RE.search(suite.name)
            if kind.uses_gpus and named and int(named.group(1)) != suite.gpus:
                problems.append(
                    f"{where}: the name says {named.group(1)} GPUs per runner but gpus = {suite.gpus}"
                )
            if kind.self_hosted and "self-hosted" not in suite.runs_on:
                problems.append(
                    f"{where}: {kind.name} runners are self-hosted; runs-on must include 'self-hosted'"
                )
        for label in suite.labels:
            if label not in labels:
                problems.append(f"{where}: unknown label {label!r}" + closest(label, list(labels)))
        for need in suite.needs:
            if need == suite.name:
                problems.append(f"{where}: a suite cannot need itself")
            elif need not in names:
                problems.append(f"{where}: needs unknown suite {need!r}" + closest(need, names))
            elif suite.enabled and need not in enabled:
                problems.append(f"{where}: needs {need!r}, which is disabled, so this stage would never run")
    try:
        tuple(TopologicalSorter({s.name: list(s.needs) for s in suites}).static_order())
    except CycleError as exc:
        problems.append(f"suites depend on each other in a cycle: {' -> '.join(exc.args[1])}")
    return problems


def _registration_problems(
    reg: Registration, kind: CIHardware, suites: dict[str, Suite], labels: dict[str, str]
) -> list[str]:
    problems: list[str] = []
    own = [s.name for s in suites.values() if s.hardware == kind.name]
    suite = suites.get(reg.suite)
    if suite is None:
        return [f"unknown suite {reg.suite!r}" + closest(reg.suite, own or list(suites))]
    if suite.hardware != kind.name:
        return [
            f"suite {reg.suite!r} runs on {suite.hardware}, but {reg.marker} registers for {kind.name}"
            + closest(reg.suite, own)
        ]
    for label in reg.labels:
        if label not in labels:
            problems.append(f"unknown label {label!r}" + closest(label, list(labels)))
        elif suite.labels and label not in suite.labels:
            problems.append(f"label {label!r} is not one of suite {suite.name}'s labels {list(suite.labels)}")
    if kind.label_gated and not reg.labels:
        hint = f" (suite {suite.name} uses {list(suite.labels)})" if suite.labels else ""
        problems.append(
            f"{reg.marker} needs labels=[...] so it never takes {kind.name} runners unasked{hint}"
        )
    gpus = suite.gpus if reg.num_gpus is None else reg.num_gpus
    if reg.num_gpus is not None and reg.num_gpus != suite.gpus:
        matching = [s.name for s in suites.values() if s.hardware == kind.name and s.gpus == reg.num_gpus]
        problems.append(
            f"num_gpus={reg.num_gpus} does not match suite {suite.name} ({suite.gpus} GPUs per runner)"
            + (
                closest(reg.suite, matching)
                if matching
                else f"; no {kind.name} suite has {reg.num_gpus} GPUs per runner"
            )
        )
    if kind.uses_gpus and reg.num_gpus is None and reg.declared_gpus is not None:
        count, line = reg.declared_gpus
        if count != suite.gpus:
            matching = [s.name for s in suites.values() if s.hardware == kind.name and s.gpus == count]
            problems.append(
                f"the file declares {GPU_COUNT_NAME} = {count} (line {line}) but suite {suite.name} has "
                f"{suite.gpus} GPUs per runner: register it on a {count}-GPU suite"
                + (f" ({', '.join(matching)})" if matching else "")
                + f", or pass num_gpus={suite.gpus} with the layout of a {suite.gpus}-GPU variant"
            )
    if reg.layout is not None:
        try:
            layout = ParallelLayout.from_mapping(reg.layout)
        except ConfigError as exc:
            problems.append(str(exc))
        else:
            problems.extend(f"layout {layout.describe()} on {gpus} GPUs: {p}" for p in layout.problems(gpus))
    return problems
