"""Output helpers: one JSON document on stdout for ``--json``, rich tables otherwise.

Text that comes from plugins, configs or users goes to rich only through :func:`plain` (or
:func:`visible`), never inside markup: rich would read ``[/]`` or ``[train]`` in it as markup (a
``MarkupError``, or text silently dropped) and ``:smile:`` as an emoji code, and would pass
terminal escape sequences and bidi overrides straight to the terminal.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def console() -> Console:
    """A console for stdout: the terminal's width, else ``COLUMNS``, else 120 columns."""
    from rich.console import Console

    wide = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
    return Console(highlight=False, soft_wrap=False, width=None if wide else 120)


def visible(value: object) -> str:
    """``str(value)`` with every non-printable character (control codes, the escape that starts
    an ANSI sequence, bidi overrides, newlines, tabs) shown as its Python escape (``\\x1b``,
    ``\\u202e``, ``\\n``), so the text cannot act on the terminal or break a table row."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else _escaped(ch) for ch in text)


_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(ch: str) -> str:
    if ch in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def plain(value: object, style: str = "") -> Text:
    """``value`` as a rich ``Text`` shown exactly as :func:`visible` writes it: no markup, no
    emoji codes, no terminal control."""
    from rich.text import Text

    return Text(visible(value), style=style)


STATUS_STYLE = {
    "ok": "green",
    "broken": "red",
    "blocked": "yellow",
    "fail": "red",
    "skip": "yellow",
    "info": "cyan",
    "warn": "yellow",
}


def styled(status: str) -> Text:
    """``status`` in its colour; padding in ``status`` is kept (the style is looked up stripped)."""
    return plain(status, STATUS_STYLE.get(status.strip(), "white"))


def quiet_libraries() -> None:
    """Keep the terminal for miles' own output: transformers' load/save progress bars and its
    once-per-process advisories (e.g. "falling back to the reference PyTorch implementation" on
    CPU) are off unless the user set these variables. Call before transformers is imported;
    child processes (Ray workers) inherit them."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
