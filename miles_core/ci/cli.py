"""``miles ci list|plan|run|est-times|workflows``.

Exit codes: 0 success (a run that selected nothing included), 1 test failures or generated
workflows out of date, 2 configuration errors (a bad suites file, registration or option).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from miles_core.ci.base import CADENCES
from miles_core.cli._output import emit_json
from miles_core.errors import ConfigError

if TYPE_CHECKING:
    from miles_core.ci.catalog import Catalog
    from miles_core.ci.selection import Selection

F = TypeVar("F", bound=Callable[..., Any])


def _tree_options(function: F) -> F:
    function = click.option(
        "--config",
        "config",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Suites file (TOML) to use instead of [tool.miles.ci] in ROOT/pyproject.toml.",
    )(function)
    return click.option(
        "--root",
        "root",
        type=click.Path(file_okay=False, exists=True, path_type=Path),
        default=None,
        help="Tree to work on (default: the nearest directory above the working directory whose "
        "pyproject.toml has [tool.miles.ci]).",
    )(function)


def _catalog(root: Path | None, config: Path | None) -> Catalog:
    from miles_core.ci.catalog import load_catalog
    from miles_core.ci.config import find_root

    ctx = click.get_current_context()
    parent = ctx.find_object(dict) or {}
    root = root or parent.get("root") or find_root(Path.cwd())
    config = config or parent.get("config")
    return load_catalog(Path(root), Path(config) if config else None)


def _suite_and_hardware(catalog: Catalog, hardware: str | None, suite: str | None) -> tuple[str, str]:
    """The suite to work on and its hardware: ``--hw`` may be left out (the suite fixes it)."""
    if hardware is not None:
        catalog.kind(hardware)
    if suite is None:
        known = [s for s in catalog.suites.values() if hardware in (None, s.hardware)]
        choices = ", ".join(f"{s.name} ({s.hardware})" for s in known) or "none"
        raise ConfigError(f"missing option --suite (the suite fixes --hw); suites: {choices}")
    found = catalog.suite(suite, hardware)
    return found.hardware, found.name


def _partition(value: str) -> tuple[int, int]:
    index, slash, count = value.partition("/")
    if not slash or not index.strip().isdigit() or not count.strip().isdigit():
        raise ConfigError(f"--partition must be I/N with 0 <= I < N (0-based), got {value!r}")
    i, n = int(index), int(count)
    if n < 1 or not 0 <= i < n:
        raise ConfigError(f"--partition {value}: need N >= 1 and 0 <= I < N (partitions are 0-based)")
    return i, n


_labels_option = click.option(
    "--labels",
    "labels",
    multiple=True,
    help="Labels to select (comma-separated or repeated; 'all' selects every label). Unknown labels are an error.",
)
_pr_labels_option = click.option(
    "--pr-labels",
    default=None,
    help="A pull request's labels, comma-separated: run-ci-<label> selects <label>, run-ci-all every "
    "label; other labels are ignored.",
)
_cadence_option = click.option(
    "--cadence",
    type=click.Choice(list(CADENCES)),
    default="regular",
    show_default=True,
    help="nightly also selects nightly-only files and every label.",
)
_json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")


@click.group()
@_tree_options
@click.pass_context
def ci(ctx: click.Context, root: Path | None, config: Path | None) -> None:
    """CI: test registrations, suites, sharding, the test runner and workflow generation.

    Test files register with register_cpu_ci / register_cuda_ci (miles_core.ci.register) or a
    plugin's marker (register_rocm_ci); suites are declared in [tool.miles.ci]. --root and
    --config may be given here or on each subcommand. Exit codes: 0 ok, 1 failures or stale
    workflows, 2 configuration errors.
    """
    ctx.obj = {"root": root, "config": config}


@ci.command("list")
@_tree_options
@click.option("--hw", "hardware", default=None, help="Only this hardware kind (cpu, cuda, rocm, ...).")
@click.option("--suite", default=None, help="Only this suite.")
@click.option("--disabled", "only_disabled", is_flag=True, help="Only disabled stages and registrations.")
@_json_option
def list_command(
    root: Path | None,
    config: Path | None,
    hardware: str | None,
    suite: str | None,
    only_disabled: bool,
    as_json: bool,
) -> None:
    """List suites and registrations; every disabled stage and file is shown with its reason and tracking link."""
    from miles_core.ci.listing import listing, render_listing

    catalog = _catalog(root, config)
    data = listing(catalog, hardware=hardware, suite=suite, only_disabled=only_disabled)
    if as_json:
        emit_json(data)
    else:
        render_listing(data)


def _selection(
    catalog: Catalog, hardware: str, suite: str, labels: tuple[str, ...], pr_labels: str | None, cadence: str
) -> Selection:
    from miles_core.ci.selection import resolve_labels, select

    return select(catalog, hardware, suite, resolve_labels(catalog, labels, pr_labels), cadence)


@ci.command("plan")
@_tree_options
@click.option("--hw", "hardware", default=None, help="Hardware kind of the suite (default: the suite's).")
@click.option("--suite", default=None, help="Suite to plan (required).")
@click.option(
    "--partitions",
    type=click.IntRange(min=1),
    default=None,
    help="Number of shards (default: the shards the stage runs, min(shards, files)).",
)
@_labels_option
@_pr_labels_option
@_cadence_option
@_json_option
def plan_command(
    root: Path | None,
    config: Path | None,
    hardware: str | None,
    suite: str | None,
    partitions: int | None,
    labels: tuple[str, ...],
    pr_labels: str | None,
    cadence: str,
    as_json: bool,
) -> None:
    """Show the assignment of files to shards, their loads and makespan / lower bound,
    next to plain longest-first greedy."""
    from miles_core.ci.selection import disabled_reason
    from miles_core.ci.sharding import greedy_shards, plan_shards

    catalog = _catalog(root, config)
    hardware, suite = _suite_and_hardware(catalog, hardware, suite)
    selection = _selection(catalog, hardware, suite, labels, pr_labels, cadence)
    count = partitions or max(1, catalog.shards(suite))
    items = [(r.path, r.est_time) for r in selection.selected]
    plan, greedy = plan_shards(items, count), greedy_shards(items, count)
    est = {r.path: r.est_time for r in selection.selected}
    warnings = [*catalog.warnings_for(suite), *selection.warnings]
    data = {
        "hardware": hardware,
        "suite": selection.suite.name,
        "partitions": [
            {"index": i, "load": load, "files": [{"path": p, "est_time": est[p]} for p in files]}
            for i, (files, load) in enumerate(zip(plan.shards, plan.loads, strict=True))
        ],
        "makespan": plan.makespan,
        "lower_bound": plan.lower_bound,
        "ratio": plan.ratio,
        "optimal": plan.optimal,
        "greedy": {"makespan": greedy.makespan, "ratio": greedy.ratio},
        "selected": len(items),
        "shards": {"configured": selection.suite.shards, "run": catalog.shards(suite)},
        "not_selected": [{"path": r.path, "why": why} for r, why in selection.not_selected],
        "disabled": [
            dict(zip(("reason", "issue"), disabled_reason(r, selection.suite), strict=True))
            | {"path": r.path, "line": r.line}
            for r in selection.disabled
        ],
        "stage_disabled": selection.suite.disabled,
        "warnings": warnings,
    }
    if as_json:
        emit_json(data)
        return
    from miles_core.ci.report import disabled_lines

    click.echo(
        f"{selection.suite.name} ({hardware}): {len(items)} file(s), {sum(est.values()):g} s, {count} partition(s)"
    )
    for i, (files, load) in enumerate(zip(plan.shards, plan.loads, strict=True)):
        click.echo(f"partition {i}: {load:g} s, {len(files)} file(s)")
        for path in files:
            click.echo(f"  {path}  {est[path]:g} s")
    click.echo(
        f"makespan {plan.makespan:g} s, lower bound {plan.lower_bound:g} s, ratio {plan.ratio:.3f}"
        + (" (optimal)" if plan.optimal else "")
        + f" (longest-first greedy: {greedy.makespan:g} s, ratio {greedy.ratio:.3f})"
    )
    for line in disabled_lines(selection):
        click.echo(line)
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)


@ci.command("run", context_settings={"help_option_names": ["-h", "--help"]})
@_tree_options
@click.option("--hw", "hardware", default=None, help="Hardware kind of the suite (default: the suite's).")
@click.option("--suite", default=None, help="Suite to run (required).")
@click.option(
    "--partition",
    default="0/1",
    show_default=True,
    help="Run shard I of N (0-based), e.g. 1/4; N is 1 (the whole suite) or the shards the stage runs.",
)
@_labels_option
@_pr_labels_option
@_cadence_option
@click.option("--list-only", is_flag=True, help="Print the plan for this partition and exit without running.")
@click.option(
    "--junit",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a merged JUnit XML report here.",
)
@click.option(
    "--summary",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Append a Markdown report to this file (e.g. $GITHUB_STEP_SUMMARY).",
)
@click.option(
    "--timeout-base",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Per-file timeout floor in seconds (default: timeout-base of the suites file); timeout = max(base, 1.25 x est_time).",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Attempts per file for failure classes the hardware kind declares retriable.",
)
@click.option("--fail-fast", is_flag=True, help="Stop after the first failing file.")
@_json_option
@click.argument("pytest_args", nargs=-1, type=click.UNPROCESSED)
def run_command(
    root: Path | None,
    config: Path | None,
    hardware: str | None,
    suite: str | None,
    partition: str,
    labels: tuple[str, ...],
    pr_labels: str | None,
    cadence: str,
    list_only: bool,
    junit: Path | None,
    summary: Path | None,
    timeout_base: float | None,
    max_attempts: int,
    fail_fast: bool,
    as_json: bool,
    pytest_args: tuple[str, ...],
) -> None:
    """Run a suite's files with pytest, one process (group) per file.

    Extra pytest arguments go after `--`, e.g. `miles ci run --hw cpu --suite stage-a-cpu -- -p no:cacheprovider`.
    Exit 0 when every file passed or nothing was selected, 1 on failures, 2 on configuration errors.
    """
    from miles_core.ci.report import markdown, plan_lines, report_dict, result_lines
    from miles_core.ci.runner import RunReport, run_files
    from miles_core.ci.sharding import plan_shards

    if any(arg.startswith("--junitxml") or arg.startswith("--junit-xml") for arg in pytest_args):
        raise ConfigError(
            "pass --junit PATH to miles ci run instead of --junitxml to pytest (one report per file is merged)"
        )
    index, count = _partition(partition)
    catalog = _catalog(root, config)
    hardware, suite = _suite_and_hardware(catalog, hardware, suite)
    shards = catalog.shards(suite)
    if count not in (1, shards):
        configured = catalog.suites[suite].shards
        raise ConfigError(
            f"--partition {partition}: suite {suite} runs {shards} shard(s) "
            f"(min(shards = {configured}, {len(catalog.runnable(suite))} file(s))): "
            f"use I/{shards}, or 0/1 for the whole suite"
        )
    selection = _selection(catalog, hardware, suite, labels, pr_labels, cadence)
    by_path = {r.path: r for r in selection.selected}
    plan = plan_shards([(r.path, r.est_time) for r in selection.selected], count)
    report = RunReport(
        selection, hardware, (index, count), plan, tuple(by_path[p] for p in plan.shards[index])
    )

    def say(line: str) -> None:
        click.echo(line, err=as_json)

    for line in plan_lines(report):
        say(line)
    if not list_only and report.files:
        run_files(
            report,
            catalog.kind(hardware),
            root=catalog.root,
            timeout_base=timeout_base or catalog.config.timeout_base,
            max_attempts=max_attempts,
            pytest_args=pytest_args,
            fail_fast=fail_fast,
            stdout=sys.stderr.fileno() if as_json else None,
            announce=say,
        )
        for line in result_lines(report):
            say(line)
    elif not list_only:
        say("nothing selected: exit 0" if not selection.selected else "no files in this partition: exit 0")
    if junit is not None and not list_only:
        from miles_core.ci.junit import write_junit

        write_junit(report, junit)
    if summary is not None and not list_only:
        with summary.open("a", encoding="utf-8") as handle:
            handle.write(markdown(report))
    if as_json:
        emit_json(report_dict(report, ran=not list_only))
    sys.exit(0 if list_only else report.exit_code)


@ci.command("est-times")
@_tree_options
@click.option(
    "--from",
    "sources",
    multiple=True,
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JUnit XML report(s) with measured durations (repeatable).",
)
@click.option(
    "--hw",
    "hardware",
    default=None,
    help="Hardware that produced reports lacking miles properties (plain pytest JUnit).",
)
@click.option(
    "--tolerance",
    type=float,
    default=0.25,
    show_default=True,
    help="Propose a change only when it differs by more than this fraction.",
)
@click.option("--write", is_flag=True, help="Rewrite the est_time literals in place.")
@_json_option
def est_times_command(
    root: Path | None,
    config: Path | None,
    sources: tuple[Path, ...],
    hardware: str | None,
    tolerance: float,
    write: bool,
    as_json: bool,
) -> None:
    """Propose est_time values from measured durations (median of passing runs, rounded up)."""
    from miles_core.ci.est_times import check_tolerance, propose, rewrite
    from miles_core.ci.junit import read_measurements

    catalog = _catalog(root, config)
    measurements = [m for source in sources for m in read_measurements(source)]
    proposals, notes = propose(catalog, measurements, hardware=hardware, tolerance=check_tolerance(tolerance))
    written = rewrite(catalog.root, proposals) if write else []
    if as_json:
        emit_json(
            {
                "proposals": [
                    {
                        "path": p.registration.path,
                        "line": p.registration.line,
                        "hardware": p.registration.hardware,
                        "suite": p.registration.suite,
                        "est_time": p.registration.est_time,
                        "measured": round(p.measured, 3),
                        "runs": p.runs,
                        "proposed": p.proposed,
                        "changed": p.changed,
                    }
                    for p in proposals
                ],
                "notes": notes,
                "written": written,
            }
        )
        return
    for p in proposals:
        reg = p.registration
        verdict = f"-> {p.proposed:g}" if p.changed else f"kept (within {tolerance:.0%})"
        click.echo(
            f"{reg.location} [{reg.hardware} {reg.suite}] est_time {reg.est_time:g} {verdict} "
            f"(measured {p.measured:.1f} s over {p.runs} run(s))"
        )
    for note in notes:
        click.echo(f"note: {note}")
    changed = sum(p.changed for p in proposals)
    if write:
        click.echo(f"rewrote {changed} est_time literal(s) in {len(written)} file(s)")
    elif changed:
        click.echo(f"{changed} change(s) proposed; apply them with --write")


@ci.command("workflows")
@_tree_options
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory to write (default: workflows-dir of the suites file, .github/workflows).",
)
@click.option(
    "--check",
    is_flag=True,
    help="Write nothing; exit 1 if the committed workflows differ from what would be generated.",
)
def workflows_command(root: Path | None, config: Path | None, out: Path | None, check: bool) -> None:
    """Generate the GitHub Actions workflows from the suites and the installed hardware kinds,
    and print the repository and runner-group settings their self-hosted gate relies on."""
    from miles_core.ci.workflows import differences, trust_settings, write

    catalog = _catalog(root, config)
    settings = trust_settings(catalog)

    def print_settings() -> None:
        if settings:
            click.echo(
                "The self-hosted gate relies on these repository and runner-group settings "
                "(docs/ci.md, 'Trust model'):"
            )
            for line in settings:
                click.echo(f"  - {line}")

    out_dir = out if out is not None else catalog.root / catalog.config.workflows_dir
    if check:
        diffs = differences(catalog, out_dir)
        for diff in diffs:
            click.echo(diff, nl=False)
        if diffs:
            click.echo(
                f"{out_dir}: workflows are out of date; run `miles ci workflows` and commit the result",
                err=True,
            )
            sys.exit(1)
        click.echo(f"{out_dir}: workflows are up to date")
        print_settings()
        return
    written, removed = write(catalog, out_dir)
    for name in written:
        click.echo(f"wrote {out_dir / name}")
    for name in removed:
        click.echo(f"removed {out_dir / name}")
    if not written and not removed:
        click.echo(f"{out_dir}: workflows are up to date")
    print_settings()
