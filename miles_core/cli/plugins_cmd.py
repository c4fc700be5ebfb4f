"""``miles plugins list|show``: what is installed, what it contributes, what was verified, its status.

Both commands are diagnostic: they always list (exit 0), record every problem instead of raising
(``MILES_PLUGIN_ERRORS=raise`` included: they show strict mode's verdict instead), and run only
the ``verify()`` of contributions that declare ``cheap_verify = True``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from miles_core import __version__
from miles_core.cli._output import console, emit_json, plain, styled, visible
from miles_core.errors import ConfigError
from miles_core.plugins import (
    CONCERN_HOOKS,
    ENV_ERRORS,
    MilesPluginManager,
    PluginRecord,
    listing_plugin_manager,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

VERIFIED_NOTE = (
    "verified: contributions that declare cheap_verify = True ran verify() here; "
    "`miles doctor` verifies every contribution"
)


@click.group()
def plugins() -> None:
    """List and inspect installed plugins (entry-point group ``miles.plugins``)."""


def _load() -> MilesPluginManager:
    pm = listing_plugin_manager()
    with pm.recording():
        pm.verify_cheap()
    return pm


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def list_plugins(as_json: bool) -> None:
    """List every discovered plugin: distribution, version, hooks, contributions, what was
    verified, load time, status.

    Always exits 0, whatever MILES_PLUGIN_ERRORS says (a malformed MILES_* setting is bad
    input: exit 2): a broken plugin (import, hook,
    verification error or a name conflict) is listed with its error, a plugin that is slow to
    load (or imports torch and the like at discovery) is flagged with its measured time, and under
    MILES_PLUGIN_ERRORS=raise the listing ends with strict mode's verdict. Only contributions that
    declare cheap_verify = True are verified here; `miles doctor` verifies everything.
    """
    pm = _load()
    records = pm.plugins()
    if as_json:
        emit_json(
            {
                "miles_version": __version__,
                "plugins": [r.to_dict() for r in records],
                "warnings": pm.warnings,
                "strict": pm.strict_verdict(),
            }
        )
        return
    from rich.table import Table

    table = Table(title=f"miles {__version__} plugins", title_justify="left")
    for column in ("plugin", "distribution", "status", "contributes", "verified", "reason"):
        table.add_column(column, overflow="fold")
    for r in records:
        table.add_row(
            _name(r),
            plain(f"{r.distribution or '-'} {r.version or ''}"),
            styled(r.status),
            _contributes(r),
            _verified_cell(r),
            _reason(r),
        )
    out = console()
    out.print(table)
    if any(r.contributes for r in records):
        out.print(plain(VERIFIED_NOTE, "dim"))
    _footer(out, pm)


def _name(r: PluginRecord) -> Text:
    from rich.text import Text

    return Text.assemble(plain(r.name), plain(" (built-in)", "dim") if r.builtin else "")


def _contributes(r: PluginRecord) -> Text:
    from rich.text import Text

    listed = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(r.contributes.items()) if v)
    shadowed = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(r.shadowed.items()) if v)
    return Text.assemble(
        plain(listed or ("" if shadowed else "-")),
        plain(f"{' ' if listed else ''}(shadowed {shadowed})", "dim") if shadowed else "",
    )


def _verified_cell(r: PluginRecord) -> Text:
    total = sum(len(v) for k, v in r.contributes.items() if k in CONCERN_HOOKS)
    if not total:
        return plain("-")
    done = sum(len(v) for v in r.verified().values())
    failed = sum(len(v) for v in r.verified("failed").values())
    text = f"{done}/{total}" + (f", {failed} failed" if failed else "")
    return plain(text, "red" if failed else "green" if done == total else "yellow")


def _reason(r: PluginRecord) -> Text:
    from rich.text import Text

    parts: list[Text | str] = []
    if r.reason:
        parts.append(plain(r.reason))
    if r.slow and r.status != "blocked":
        parts.extend(["; " if parts else "", plain(r.slow, "yellow")])
    return Text.assemble(*parts)


def _footer(out: Console, pm: MilesPluginManager) -> None:
    from rich.text import Text

    for warning in pm.warnings:
        out.print(Text.assemble(("warning: ", "yellow"), plain(warning)))
    verdict = pm.strict_verdict()
    if verdict["policy"] != "raise":
        return
    if verdict["passes"]:
        out.print(Text.assemble((f"{ENV_ERRORS}=raise: ", "bold"), ("no plugin is broken; strict mode passes", "green")))
    else:
        out.print(
            Text.assemble(
                (f"{ENV_ERRORS}=raise: ", "bold"),
                ("every command that loads plugins fails", "red"),
                plain(f" (broken: {', '.join(verdict['broken'])}); listed anyway, since listing is diagnostic"),
            )
        )


@plugins.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def show_plugin(name: str, as_json: bool) -> None:
    """Show one plugin in full, tracebacks included. NAME is the plugin's name, its
    distribution's, or DIST:NAME (needed when two distributions declare the same name).

    Like `list`, it always shows the plugin (exit 0 once NAME names one) and under
    MILES_PLUGIN_ERRORS=raise adds strict mode's verdict.
    """
    pm = _load()
    try:
        record = pm.get(name)
    except KeyError:
        known = ", ".join(pm.selector(r) for r in pm.plugins()) or "none"
        raise ConfigError(f"no plugin named {name!r} (installed: {known})") from None
    data = record.to_dict()
    data["import_ms"] = data["load"]["import_ms"]
    data["tracebacks"] = [p.detail for p in record.problems if p.detail]
    data["strict"] = pm.strict_verdict()
    if as_json:
        emit_json(data)
        return
    from rich.text import Text

    out = console()
    out.print(
        Text.assemble(
            plain(record.name, "bold"),
            plain(f"  {record.distribution or '-'} {record.version or ''}  "),
            styled(record.status),
        )
    )
    out.print(plain(f"key: {record.key}" + ("  (built-in)" if record.builtin else "")))
    out.print(plain(f"module: {record.module_path}"))
    if record.import_ms is not None:
        out.print(plain(f"load: import {record.import_ms:.1f} ms, hooks {record.hook_ms:.1f} ms"))
    if record.slow:
        out.print(plain(record.slow, "yellow"))
    out.print(plain(f"hooks: {', '.join(record.hooks) or '-'}"))
    for concern in [*CONCERN_HOOKS, "commands"]:
        names = record.contributes.get(concern)
        if names:
            states = record.verification.get(concern, {})
            shown = ", ".join(
                n if concern == "commands" else f"{n} ({states.get(n, 'not verified')})" for n in names
            )
            out.print(plain(f"{concern}: {shown}"))
        if record.shadowed.get(concern):
            out.print(plain(f"{concern} shadowed by a higher-priority plugin: {', '.join(record.shadowed[concern])}"))
    if record.reason:
        out.print(Text.assemble(("reason: ", "red"), plain(record.reason)))
    _footer(out, pm)
    for problem in record.problems:
        if problem.detail:
            click.echo("\n".join(visible(line) for line in problem.detail.split("\n")))
