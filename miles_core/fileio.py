"""Crash-safe file writes: readers see the old content or the new, never a torn file."""

from __future__ import annotations

import json
import os
from typing import Any


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to a unique temporary file next to ``path`` and rename it over ``path``."""
    # os.path rather than pathlib: the entry-point cache writes through here on the start-up
    # path of every `miles` command, and importing pathlib costs more than the write
    target = os.fspath(path)
    head, name = os.path.split(target)
    temporary = os.path.join(head, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


def write_json_atomic(path: str | os.PathLike[str], value: Any, mode: int = 0o644) -> None:
    write_bytes_atomic(path, (json.dumps(value, indent=2, default=str) + "\n").encode(), mode)
