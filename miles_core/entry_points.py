"""Entry-point discovery with a validated on-disk cache.

``importlib.metadata`` costs tens of milliseconds to import (email, zipfile, csv, ...), which is
most of what ``miles plugins list`` would spend before doing any work. The answer only changes when
a distribution is installed, removed or upgraded, and each of those adds or removes a ``.dist-info``
directory, which changes the modification time of the directory holding it. So the scan result is
cached per interpreter and group, stamped with the ``mtime_ns`` of every ``sys.path`` directory,
and rescanned through ``importlib.metadata`` whenever any stamp differs.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import asdict, dataclass

from miles_core.fileio import write_bytes_atomic

CACHE_VERSION = 1
ENV_NO_CACHE = "MILES_NO_ENTRY_POINT_CACHE"


@dataclass(frozen=True)
class EntryPointInfo:
    name: str
    value: str
    distribution: str | None
    version: str | None


def _path_stamp() -> list[tuple[str, int]]:
    stamp = []
    for entry in sys.path:
        path = entry or os.getcwd()
        try:
            stamp.append((path, os.stat(path).st_mtime_ns))
        except OSError:
            stamp.append((path, -1))
    return stamp


def _cache_file(group: str) -> str:
    # os.path rather than pathlib: importing pathlib costs more than this whole module
    root = os.environ.get("MILES_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "miles"
    )
    key = zlib.adler32(f"{sys.executable}\0{group}".encode()) & 0xFFFFFFFF
    return os.path.join(root, "entry-points", f"{key:08x}.json")


def _scan(group: str) -> list[EntryPointInfo]:
    from importlib import metadata

    found = []
    for ep in metadata.entry_points(group=group):
        dist = ep.dist
        found.append(
            EntryPointInfo(ep.name, ep.value, dist.name if dist else None, dist.version if dist else None)
        )
    return found


def entry_points(group: str) -> list[EntryPointInfo]:
    """Every entry point of ``group`` visible on ``sys.path``."""
    if os.environ.get(ENV_NO_CACHE):
        return _scan(group)
    stamp = [list(s) for s in _path_stamp()]
    cache = _cache_file(group)
    try:
        with open(cache, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("version") == CACHE_VERSION and data.get("stamp") == stamp:
            return [EntryPointInfo(**item) for item in data["entry_points"]]
    except (OSError, ValueError, TypeError, KeyError):
        pass  # missing, unreadable or from an older format: rescan below
    found = _scan(group)
    payload = {"version": CACHE_VERSION, "stamp": stamp, "entry_points": [asdict(e) for e in found]}
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        write_bytes_atomic(cache, json.dumps(payload).encode())
    except OSError:
        pass  # a read-only home only costs the next run a rescan
    return found
