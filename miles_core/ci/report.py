"""Renderings of a run: plain text for logs, Markdown for the job summary, a dict for --json.

Every rendering lists the disabled entries of the suite with their reasons and tracking links,
and flags files whose elapsed time drifted from ``est_time`` by more than 2x.
"""

from __future__ import annotations

from typing import Any

from miles_core.ci.runner import DRIFT_FACTOR, FileResult, RunReport
from miles_core.ci.selection import Selection, disabled_reason


def _heading(report: RunReport) -> str:
    index, count = report.partition
    labels = ", ".join(sorted(report.selection.labels)) or "none"
    return (
        f"miles ci: {report.hardware} / {report.selection.suite.name}, partition {index}/{count}, "
        f"cadence {report.selection.cadence}, labels: {labels}"
    )


def disabled_lines(selection: Selection) -> list[str]:
    suite = selection.suite
    lines = []
    if not suite.enabled:
        link = f" (tracking: {suite.issue})" if suite.issue else ""
        lines.append(f"stage {suite.name} is DISABLED: {suite.disabled}{link}; it runs no job")
    for reg in selection.disabled:
        reason, issue = disabled_reason(reg, suite)
        link = f" (tracking: {issue})" if issue else ""
        lines.append(f"disabled {reg.location}: {reason}{link}")
    return lines


def plan_lines(report: RunReport) -> list[str]:
    selection, plan = report.selection, report.plan
    lines = [_heading(report)]
    lines.extend(f"warning: {w}" for w in selection.warnings)
    lines.append(
        f"selected {len(selection.selected)} file(s), est {selection.est_total:g} s, over {len(plan.loads)} partition(s): "
        f"loads {', '.join(f'{load:g}' for load in plan.loads) or '-'} s "
        f"(makespan / lower bound = {plan.ratio:.3f})"
    )
    lines.append(
        f"this partition: {len(report.files)} file(s), est {sum(r.est_time for r in report.files):g} s"
    )
    lines.extend(f"  {reg.path}  est {reg.est_time:g} s" for reg in report.files)
    for reg, why in selection.not_selected:
        lines.append(f"not selected {reg.location}: {why}")
    lines.extend(disabled_lines(selection))
    return lines


def _drift_text(result: FileResult) -> str:
    drift = result.drift
    if drift is None:
        return "-"
    return f"{drift:.2f}x" + (" DRIFT" if result.drifted else "")


def result_lines(report: RunReport) -> list[str]:
    width = max((len(r.registration.path) for r in report.results), default=4)
    lines = [f"{'file':<{width}}  {'status':<10} {'tries':>5} {'elapsed':>9} {'est':>7}  drift"]
    for r in report.results:
        lines.append(
            f"{r.registration.path:<{width}}  {r.status:<10} {len(r.attempts):>5} {r.elapsed:>8.1f}s "
            f"{r.registration.est_time:>6g}s  {_drift_text(r)}"
        )
    passed = sum(1 for r in report.results if not r.failed and r.status != "not run")
    failed = report.failures
    not_run = sum(1 for r in report.results if r.status == "not run")
    elapsed = sum(r.total_elapsed for r in report.results)
    est = sum(r.registration.est_time for r in report.results)
    summary = f"result: {passed} passed, {len(failed)} failed"
    if not_run:
        summary += f", {not_run} not run (--fail-fast)"
    if failed:
        summary += " (" + "; ".join(f"{r.status}: {r.registration.path}" for r in failed) + ")"
    lines.append(f"{summary}; {elapsed:.1f} s elapsed vs {est:g} s estimated")
    drifted = [r for r in report.results if r.drifted]
    if drifted:
        lines.append(
            f"est_time is off by more than {DRIFT_FACTOR:g}x for {len(drifted)} file(s); refresh with "
            "`miles ci est-times --from <junit> --write`"
        )
    lines.extend(disabled_lines(report.selection))
    return lines


def markdown(report: RunReport) -> str:
    index, count = report.partition
    out = [
        f"### {report.selection.suite.name} ({report.hardware}), partition {index}/{count}",
        "",
        "| file | status | tries | elapsed (s) | est_time (s) | drift |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in report.results:
        out.append(
            f"| `{r.registration.path}` | {r.status} | {len(r.attempts)} | {r.elapsed:.1f} | "
            f"{r.registration.est_time:g} | {_drift_text(r)} |"
        )
    disabled = disabled_lines(report.selection)
    if disabled:
        out += ["", "**Disabled**", "", *[f"- {line}" for line in disabled]]
    return "\n".join(out) + "\n"


def report_dict(report: RunReport, *, ran: bool) -> dict[str, Any]:
    selection, plan = report.selection, report.plan
    index, count = report.partition
    data: dict[str, Any] = {
        "hardware": report.hardware,
        "suite": selection.suite.name,
        "partition": {"index": index, "count": count},
        "cadence": selection.cadence,
        "labels": sorted(selection.labels),
        "warnings": list(selection.warnings),
        "plan": {
            "loads": list(plan.loads),
            "makespan": plan.makespan,
            "lower_bound": plan.lower_bound,
            "ratio": plan.ratio,
        },
        "files": [{"path": r.path, "est_time": r.est_time} for r in report.files],
        "not_selected": [{"path": r.path, "line": r.line, "why": why} for r, why in selection.not_selected],
        "stage_disabled": None
        if selection.suite.enabled
        else {"reason": selection.suite.disabled, "issue": selection.suite.issue},
        "disabled": [
            dict(zip(("reason", "issue"), disabled_reason(r, selection.suite), strict=True))
            | {"path": r.path, "line": r.line}
            for r in selection.disabled
        ],
    }
    if ran:
        data["results"] = [
            {
                "path": r.registration.path,
                "status": r.status,
                "attempts": [
                    {"status": a.status, "elapsed": round(a.elapsed, 3), "returncode": a.returncode}
                    for a in r.attempts
                ],
                "elapsed": round(r.elapsed, 3),
                "est_time": r.registration.est_time,
                "timeout": r.timeout,
                "drift": None if r.drift is None else round(r.drift, 3),
                "drifted": r.drifted,
            }
            for r in report.results
        ]
        data["exit_code"] = report.exit_code
    return data
