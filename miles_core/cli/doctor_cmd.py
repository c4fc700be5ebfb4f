"""``miles doctor``: activate every concern, report what was selected, applied and verified."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from miles_core.cli._output import console, emit_json, plain, quiet_libraries, styled
from miles_core.doctor import CheckResult, DoctorReport, run_doctor
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
    if as_json:
        err = sys.stderr

        def progress(concern: str, _results: list[CheckResult], seconds: float) -> None:
            print(f"miles doctor: {concern} checked in {seconds:.1f} s", file=err, flush=True)

        # progress for a person watching; scripts reading stdout get exactly one JSON document
        report = run_doctor(get_plugin_manager(), on_concern=progress if err.isatty() else None)
        emit_json(report.to_dict())
    else:
        out = console()
        report = run_doctor(get_plugin_manager(),
                            on_concern=lambda concern, results, seconds: render_concern(concern, results, seconds, out))
        render_verdict(report, out)
    if not report.ok:
        sys.exit(1)


def render_report(report: DoctorReport, out: Console) -> None:
    """The doctor's report as text: each concern (with its wall time when the report has it), then the verdict."""
    for concern in dict.fromkeys(r.concern for r in report.results):
        results = [r for r in report.results if r.concern == concern]
        render_concern(concern, results, report.concern_seconds.get(concern), out)
    render_verdict(report, out)


def render_concern(concern: str, results: list[CheckResult], seconds: float | None, out: Console) -> None:
    """One concern's results; every item, detail and datum is shown verbatim (see
    :func:`miles_core.cli._output.plain`), never read as markup."""
    from rich.text import Text

    took = "" if seconds is None else f" ({seconds:.1f} s)"
    out.print(Text.assemble("\n", plain(concern, "bold"), plain(took, "dim")))
    for r in results:
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


def render_verdict(report: DoctorReport, out: Console) -> None:
    from rich.text import Text

    verdict = ("all required checks passed", "green") if report.ok else ("some required checks failed", "red")
    out.print(
        Text.assemble(
            "\n", verdict, plain(f" ({report.seconds:.1f} s); fingerprint {report.fingerprint['digest'][:16]}")
        )
    )
