"""Which registrations of a suite a run selects, and why the others are not run.

A registration is selected when it is enabled, its stage is enabled, it is not nightly-only
(unless the cadence is nightly), and it has no labels or at least one selected label. The
nightly cadence selects every label. Disabled entries are reported whatever the labels and
cadence are: they never silently vanish from a report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from miles_core.ci.base import CADENCES, Suite
from miles_core.ci.catalog import Catalog
from miles_core.ci.config import closest
from miles_core.ci.discovery import Registration
from miles_core.errors import ConfigError

PR_LABEL_PREFIX = "run-ci-"
ALL = "all"


@dataclass(frozen=True)
class LabelSelection:
    labels: frozenset[str]
    warnings: tuple[str, ...] = ()


def resolve_labels(
    catalog: Catalog, labels: Iterable[str] = (), pr_labels: str | None = None
) -> LabelSelection:
    """Selected labels from ``--labels`` (strict: unknown names are an error) and ``--pr-labels``
    (a pull request's labels, comma separated: ``run-ci-<label>`` selects a label,
    ``run-ci-all`` every label, other labels are ignored, unknown ``run-ci-*`` ones warned about)."""
    known = set(catalog.labels)
    selected: set[str] = set()

    def add(bare: str) -> bool:
        if bare == ALL:
            selected.update(known)
        elif bare in known:
            selected.add(bare)
        else:
            return False
        return True

    for name in _split(labels):
        if not add(name.removeprefix(PR_LABEL_PREFIX)):
            raise ConfigError(
                f"--labels: unknown label {name!r}"
                + closest(name.removeprefix(PR_LABEL_PREFIX), sorted(known | {ALL}))
            )
    warnings = []
    for name in _split([pr_labels or ""]):
        bare = name.removeprefix(PR_LABEL_PREFIX)
        if name.startswith(PR_LABEL_PREFIX) and not add(bare):
            warnings.append(
                f"pull-request label {name!r} names no known label" + closest(bare, sorted(known | {ALL}))
            )
    return LabelSelection(frozenset(selected), tuple(warnings))


def _split(values: Iterable[str]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


@dataclass(frozen=True)
class Selection:
    suite: Suite
    cadence: str
    labels: frozenset[str]
    selected: tuple[Registration, ...]
    disabled: tuple[Registration, ...]
    not_selected: tuple[tuple[Registration, str], ...]
    warnings: tuple[str, ...] = field(default=())

    @property
    def est_total(self) -> float:
        return sum(r.est_time for r in self.selected)


def select(
    catalog: Catalog, hardware: str, suite_name: str, labels: LabelSelection, cadence: str
) -> Selection:
    if cadence not in CADENCES:
        raise ConfigError(f"--cadence: unknown cadence {cadence!r}" + closest(cadence, CADENCES))
    suite = catalog.suite(suite_name, hardware)
    chosen = labels.labels | (frozenset(catalog.labels) if cadence == "nightly" else frozenset())
    selected, disabled, not_selected = [], [], []
    for reg in catalog.in_suite(suite.name):
        if not reg.enabled or not suite.enabled:
            disabled.append(reg)
        elif reg.nightly and cadence != "nightly":
            not_selected.append((reg, "nightly only"))
        elif reg.labels and not chosen.intersection(reg.labels):
            not_selected.append((reg, f"needs label {' or '.join(reg.labels)}"))
        else:
            selected.append(reg)
    return Selection(
        suite=suite,
        cadence=cadence,
        labels=chosen,
        selected=tuple(selected),
        disabled=tuple(disabled),
        not_selected=tuple(not_selected),
        warnings=labels.warnings,
    )


def disabled_reason(reg: Registration, suite: Suite) -> tuple[str, str | None]:
    """Why ``reg`` does not run and its tracking link: its own reason, else its stage's."""
    if reg.disabled is not None:
        return reg.disabled, reg.issue
    return f"stage {suite.name} is disabled: {suite.disabled}", suite.issue
