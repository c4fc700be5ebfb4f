"""Output helpers: one JSON document on stdout for ``--json``, rich tables otherwise."""

from __future__ import annotations

import json
import os
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


def quiet_libraries() -> None:
    """Keep the terminal for miles' own output: transformers' load/save progress bars and its
    once-per-process advisories (e.g. "falling back to the reference PyTorch implementation" on
    CPU) are off unless the user set these variables. Call before transformers is imported;
    child processes (Ray workers) inherit them."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
