"""``miles doctor`` check for the CI concern: every hardware kind verifies, and the suites file
and registrations of the tree in the current directory (if it has one) are valid."""

from __future__ import annotations

from pathlib import Path

from miles_core.doctor import CheckResult
from miles_core.plugins import MilesPluginManager


def check(pm: MilesPluginManager) -> list[CheckResult]:
    from miles_core.ci.catalog import load_catalog
    from miles_core.ci.config import find_root
    from miles_core.errors import MilesError

    results = []
    for contribution in pm.active_contributions("ci"):
        kind = contribution.obj
        pm.verify(contribution, kind.verify)
        detail = f"marker {kind.marker_name}; retries {', '.join(sorted(kind.retriable)) or 'nothing'}"
        results.append(CheckResult("ci", kind.name, "ok", detail, plugin=contribution.plugin.name))
    root = find_root(Path.cwd())
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and "[tool.miles.ci" in pyproject.read_text(encoding="utf-8"):
        try:
            catalog = load_catalog(root, pm=pm)
        except MilesError as exc:
            results.append(CheckResult("ci", f"suites of {root}", "fail", str(exc), required=False))
        else:
            detail = f"{len(catalog.suites)} suites, {len(catalog.registrations)} registrations in {len(catalog.files)} files"
            results.append(CheckResult("ci", f"suites of {root}", "ok", detail, required=False))
    return results
