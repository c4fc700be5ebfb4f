"""``miles doctor``: activate every concern, report what was selected, applied and verified."""

from __future__ import annotations

import sys

import click

from miles_core.cli._output import console, emit_json, quiet_libraries, styled
from miles_core.doctor import run_doctor
from miles_core.plugins import get_plugin_manager


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a report.")
def doctor(as_json: bool) -> None:
    """Activate every concern and report each result.

    Exits 0 only if every required check passed; 1 otherwise (a broken plugin, a backend or patch
    that fails verification, ...).
    """
    quiet_libraries()
    report = run_doctor(get_plugin_manager())
    if as_json:
        emit_json(report.to_dict())
    else:
        out = console()
        concern = None
        for r in report.results:
            if r.concern != concern:
                concern = r.concern
                out.print(f"\n[bold]{concern}[/]")
            flag = "" if r.required else " [dim](optional)[/]"
            out.print(f"  {styled(r.status.ljust(4))} {r.item}{flag}: {r.detail}")
            for key, value in r.data.items():
                if key != "traceback":
                    out.print(f"       [dim]{key}: {value}[/]")
        verdict = (
            "[green]all required checks passed[/]" if report.ok else "[red]some required checks failed[/]"
        )
        out.print(f"\n{verdict} ({report.seconds:.1f} s); fingerprint {report.fingerprint['digest'][:16]}")
    if not report.ok:
        sys.exit(1)
