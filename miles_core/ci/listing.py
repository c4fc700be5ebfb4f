"""``miles ci list``: suites, registrations, and everything disabled with its reason and link."""

from __future__ import annotations

from typing import Any

from miles_core.ci.catalog import Catalog
from miles_core.ci.selection import disabled_reason


def listing(
    catalog: Catalog, *, hardware: str | None = None, suite: str | None = None, only_disabled: bool = False
) -> dict[str, Any]:
    if hardware is not None:
        catalog.kind(hardware)
    if suite is not None:
        catalog.suite(suite, hardware)
    suites = [
        s for s in catalog.suites.values() if hardware in (None, s.hardware) and suite in (None, s.name)
    ]
    names = {s.name for s in suites}
    registrations = [r for r in catalog.registrations if r.suite in names]
    disabled: list[dict[str, Any]] = [
        {"stage": s.name, "hardware": s.hardware, "reason": s.disabled, "issue": s.issue, "source": s.source}
        for s in suites
        if not s.enabled
    ]
    for reg in registrations:
        stage = catalog.suites[reg.suite]
        if not reg.enabled or not stage.enabled:
            reason, issue = disabled_reason(reg, stage)
            disabled.append(
                {"path": reg.path, "line": reg.line, "suite": reg.suite, "reason": reason, "issue": issue}
            )
    if only_disabled:
        suites = [s for s in suites if not s.enabled]
        registrations = [r for r in registrations if not r.enabled or not catalog.suites[r.suite].enabled]
    return {
        "root": str(catalog.root),
        "config": catalog.config.source,
        "hardware": [
            {
                "name": kind.name,
                "plugin": catalog.providers[kind.name],
                "marker": kind.marker_name,
                "self_hosted": kind.self_hosted,
                "retriable": sorted(kind.retriable),
            }
            for kind in catalog.kinds.values()
            if hardware in (None, kind.name)
        ],
        "labels": dict(sorted(catalog.labels.items())),
        "suites": [
            {
                "name": s.name,
                "hardware": s.hardware,
                "runs_on": list(s.runs_on),
                "gpus": s.gpus,
                "host_gpus": s.host_gpus,
                "shards": s.shards,
                "cadence": list(s.cadence),
                "labels": list(s.labels),
                "needs": list(s.needs),
                "enabled": s.enabled,
                "disabled": s.disabled,
                "issue": s.issue,
                "source": s.source,
                "files": len(catalog.in_suite(s.name)),
                "runnable_files": len(catalog.runnable(s.name)),
                "shards_run": catalog.shards(s.name),
                "est_total": sum(r.est_time for r in catalog.in_suite(s.name) if r.enabled),
            }
            for s in suites
        ],
        "registrations": [
            r.to_dict() | {"stage_disabled": catalog.suites[r.suite].disabled} for r in registrations
        ],
        "disabled": disabled,
        "warnings": [w.message for w in catalog.warnings if w.suite is None or w.suite in names],
    }


def render_listing(data: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from miles_core.cli._output import console

    out = console()
    suites = Table(title=f"CI suites ({data['config']})", title_justify="left")
    for column in (
        "suite",
        "hardware",
        "runners",
        "gpus",
        "shards run",
        "cadence",
        "files",
        "est (s)",
        "status",
    ):
        suites.add_column(column, overflow="fold")
    for s in data["suites"]:
        gpus = str(s["gpus"]) + (f" of {s['host_gpus']}" if s["host_gpus"] else "")
        status = "[green]enabled[/]" if s["enabled"] else f"[yellow]DISABLED[/]: {escape(s['disabled'])}"
        suites.add_row(
            s["name"],
            s["hardware"],
            ",".join(s["runs_on"]),
            gpus,
            str(s["shards_run"]) + (f" of {s['shards']}" if s["shards_run"] != s["shards"] else ""),
            ",".join(s["cadence"]),
            str(s["files"]),
            f"{s['est_total']:g}",
            status,
        )
    out.print(suites)
    tests = Table(title="Registrations", title_justify="left")
    for column in ("file", "hardware", "suite", "est (s)", "labels", "flags"):
        tests.add_column(column, overflow="fold")
    for r in data["registrations"]:
        flags = ", ".join(
            flag
            for flag in (
                "nightly" if r["nightly"] else "",
                "[yellow]disabled[/]" if r["disabled"] else "",
                "[yellow]stage disabled[/]" if r["stage_disabled"] else "",
            )
            if flag
        )
        tests.add_row(
            escape(f"{r['path']}:{r['line']}"),
            r["hardware"],
            r["suite"],
            f"{r['est_time']:g}",
            ",".join(r["labels"]),
            flags,
        )
    out.print(tests)
    if data["disabled"]:
        out.print("[bold]Disabled[/] (never run; re-enable when the tracking issue is resolved)")
        for d in data["disabled"]:
            what = (
                f"stage {d['stage']} ({d['hardware']})"
                if "stage" in d
                else f"{d['path']}:{d['line']} [{d['suite']}]"
            )
            link = f"  tracking: {escape(d['issue'])}" if d["issue"] else "  [red]no tracking issue[/]"
            out.print(f"  {escape(what)}: {escape(d['reason'])}{link}")
    for warning in data["warnings"]:
        out.print(f"[yellow]warning:[/] {escape(warning)}")
