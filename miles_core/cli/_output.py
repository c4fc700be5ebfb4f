"""Output helpers: one JSON document on stdout for ``--json``, rich tables otherwise."""

from __future__ import annotations

import json
import sys
from typing import Any

import click


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 120)


STATUS_STYLE = {
    "ok": "green",
    "broken": "red",
    "blocked": "yellow",
    "fail": "red",
    "skip": "yellow",
    "info": "cyan",
}


def styled(status: str) -> str:
    """``status`` in its colour; padding in ``status`` is kept (the style is looked up stripped)."""
    return f"[{STATUS_STYLE.get(status.strip(), 'white')}]{status}[/]"
