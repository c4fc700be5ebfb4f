"""Crash-safe file writes: readers see the old content or the new, never a torn file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to a unique temporary file next to ``path`` and rename it over ``path``."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike[str], value: Any, mode: int = 0o644) -> None:
    write_bytes_atomic(path, (json.dumps(value, indent=2, default=str) + "\n").encode(), mode)
