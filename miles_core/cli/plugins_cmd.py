"""``miles plugins list|show``: what is installed, what it contributes, and its status."""

from __future__ import annotations

import click

from miles_core import __version__
from miles_core.cli._output import console, emit_json, styled
from miles_core.errors import ConfigError
from miles_core.plugins import CONCERN_HOOKS, get_plugin_manager


@click.group()
def plugins() -> None:
    """List and inspect installed plugins (entry-point group ``miles.plugins``)."""


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def list_plugins(as_json: bool) -> None:
    """List every discovered plugin: distribution, version, hooks, contributions, status.

    Always exits 0: a broken plugin is reported here, with its error, not raised.
    """
    pm = get_plugin_manager()
    pm.collect_all()
    records = pm.plugins()
    if as_json:
        emit_json(
            {
                "miles_version": __version__,
                "plugins": [r.to_dict() for r in records],
                "warnings": pm.warnings,
            }
        )
        return
    from rich.table import Table

    table = Table(title=f"miles {__version__} plugins", title_justify="left")
    for column in ("plugin", "distribution", "status", "contributes", "reason"):
        table.add_column(column, overflow="fold")
    for r in records:
        contributes = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(r.contributes.items()) if v)
        shadowed = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(r.shadowed.items()) if v)
        if shadowed:
            contributes += f" [dim](shadowed {shadowed})[/]"
        table.add_row(
            r.name + (" [dim](built-in)[/]" if r.builtin else ""),
            f"{r.distribution or '-'} {r.version or ''}",
            styled(r.status),
            contributes or "-",
            r.reason or "",
        )
    out = console()
    out.print(table)
    for warning in pm.warnings:
        out.print(f"[yellow]warning:[/] {warning}")


@plugins.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def show_plugin(name: str, as_json: bool) -> None:
    """Show one plugin (by plugin or distribution NAME) in full, tracebacks included."""
    pm = get_plugin_manager()
    pm.collect_all()
    try:
        record = pm.get(name)
    except KeyError:
        known = ", ".join(r.name for r in pm.plugins()) or "none"
        raise ConfigError(f"no plugin named {name!r} (installed: {known})") from None
    data = record.to_dict()
    data["import_ms"] = None if record.import_ms is None else round(record.import_ms, 2)
    data["tracebacks"] = [p.detail for p in record.problems if p.detail]
    if as_json:
        emit_json(data)
        return
    out = console()
    out.print(
        f"[bold]{record.name}[/]  {record.distribution or '-'} {record.version or ''}  {styled(record.status)}"
    )
    out.print(f"module: {record.module_path}" + ("  (built-in)" if record.builtin else ""))
    if record.import_ms is not None:
        out.print(f"import: {record.import_ms:.1f} ms")
    out.print(f"hooks: {', '.join(record.hooks) or '-'}")
    for concern in [*CONCERN_HOOKS, "commands"]:
        if record.contributes.get(concern):
            out.print(f"{concern}: {', '.join(record.contributes[concern])}")
        if record.shadowed.get(concern):
            out.print(f"{concern} shadowed by a higher-priority plugin: {', '.join(record.shadowed[concern])}")
    if record.reason:
        out.print(f"[red]reason:[/] {record.reason}")
    for problem in record.problems:
        if problem.detail:
            click.echo(problem.detail)
