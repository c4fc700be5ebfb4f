"""Entry-point discovery with a validated on-disk cache.

``importlib.metadata`` costs tens of milliseconds to import (email, zipfile, csv, ...), which is
most of what ``miles plugins list`` would spend before doing any work. The answer changes when a
distribution is installed, removed or upgraded -- each adds or removes a ``.dist-info`` directory,
which changes the modification time of the directory holding it -- or when a distribution's
``entry_points.txt`` is edited in place (an editable install re-run, a hand edit), which changes
nothing but that file. So the scan result is cached per interpreter and group, stamped with the
``mtime_ns`` of every ``sys.path`` directory and the ``(mtime_ns, size, inode)`` of every
``entry_points.txt`` of the ``.dist-info`` / ``.egg-info`` directories in them, and rescanned
through ``importlib.metadata`` whenever any stamp differs.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import asdict, dataclass

from miles_core.fileio import write_bytes_atomic

CACHE_VERSION = 2
ENV_NO_CACHE = "MILES_NO_ENTRY_POINT_CACHE"


@dataclass(frozen=True)
class EntryPointInfo:
    name: str
    value: str
    distribution: str | None
    version: str | None


def _path_stamp() -> list[list[object]]:
    """``[path, mtime_ns, [[metadata dir, mtime_ns, size, inode] ...]]`` per ``sys.path`` entry
    (``-1`` where there is nothing to stat), the metadata dirs being those holding an
    ``entry_points.txt``."""
    stamp: list[list[object]] = []
    for entry in sys.path:
        path = entry or os.getcwd()
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            stamp.append([path, -1, []])
            continue
        files: list[list[object]] = []
        try:
            with os.scandir(path) as it:
                names = sorted(e.name for e in it if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:  # a zip file or an unreadable directory: its mtime is all there is
            names = []
        for name in names:
            try:
                st = os.stat(os.path.join(path, name, "entry_points.txt"))
            except OSError:
                continue
            files.append([name, st.st_mtime_ns, st.st_size, st.st_ino])
        stamp.append([path, mtime, files])
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
    stamp = _path_stamp()
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
