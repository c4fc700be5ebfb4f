"""``miles doctor``: activate every concern, report what was selected, applied and verified."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from miles_core.cli._output import console, emit_json, plain, quiet_libraries, styled
from miles_core.doctor import DoctorReport, run_doctor
from miles_core.plugins import get_plugin_manager

if TYPE_CHECKING:
    from rich.console import Console


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a report.")
def doctor(as_json: bool) -> None:
    """Activate every concern and report each result.

    Exits 0 only if every required check passed; 1 otherwise (a broken plugin, a backend or patch
    that fails verification, ...). Warnings never fail it: a plugin slow to load (with its
    measured time), a plugin's hardware backend replacing a built-in one.
    """
    quiet_libraries()
    report = run_doctor(get_plugin_manager())
    if as_json:
        emit_json(report.to_dict())
    else:
        render_report(report, console())
    if not report.ok:
        sys.exit(1)


def render_report(report: DoctorReport, out: Console) -> None:
    """The doctor's report as text; every item, detail and datum is shown verbatim (see
    :func:`miles_core.cli._output.plain`), never read as markup."""
    from rich.text import Text

    concern = None
    for r in report.results:
        if r.concern != concern:
            concern = r.concern
            out.print(Text.assemble("\n", plain(concern, "bold")))
        out.print(
            Text.assemble(
                "  ",
                styled(r.status.ljust(4)),
                " ",
                plain(r.item),
                plain(" (optional)", "dim") if not r.required else "",
                ": ",
                plain(r.detail),
            )
        )
        for key, value in r.data.items():
            if key != "traceback":
                out.print(Text.assemble("       ", plain(f"{key}: {value}", "dim")))
    verdict = ("all required checks passed", "green") if report.ok else ("some required checks failed", "red")
    out.print(
        Text.assemble(
            "\n", verdict, plain(f" ({report.seconds:.1f} s); fingerprint {report.fingerprint['digest'][:16]}")
        )
    )
