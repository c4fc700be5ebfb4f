"""Entry-point discovery with a validated on-disk cache.

``importlib.metadata`` costs tens of milliseconds to import (email, zipfile, csv, ...), which is
most of what ``miles plugins list`` would spend before doing any work. Its answer depends on the
metadata directories (``.dist-info`` / ``.egg-info``) in each ``sys.path`` directory -- installing,
removing or upgrading a distribution adds, removes or renames one, and one without entry points
still matters, since the first distribution of a name on ``sys.path`` hides later ones -- and on
each ``entry_points.txt`` in them, which an editable install re-run or a hand edit changes in
place. So the scan result is cached per interpreter, group and ``sys.path``, stamped with the
names of every ``sys.path`` directory's metadata directories, the ``(mtime_ns, size, inode)`` of
each one's ``entry_points.txt``, and the ``mtime_ns`` of ``sys.path`` entries that are files
(zips), and rescanned through ``importlib.metadata`` whenever the stamp differs. The directories' own
modification times are not part of it: any file created in a ``sys.path`` directory changes
them -- ``python -m miles_core`` has the working directory there, where runs write their
output -- and would throw the cache away for nothing.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from typing import NamedTuple

from miles_core.cache_dir import cache_root
from miles_core.fileio import write_bytes_atomic

CACHE_VERSION = 3
ENV_NO_CACHE = "MILES_NO_ENTRY_POINT_CACHE"


class EntryPointInfo(NamedTuple):
    """One entry point of a group and the distribution that declares it (a named tuple, not a
    dataclass: every command builds this class, and a frozen dataclass costs ten times more to
    define)."""

    name: str
    value: str
    distribution: str | None
    version: str | None


def _path_stamp() -> list[list[object]]:
    """Per ``sys.path`` entry: ``[path, [[metadata dir, mtime_ns, size, inode] or [metadata dir],
    ...]]`` for a directory (the numbers are its ``entry_points.txt``'s, where it has one),
    ``[path, mtime_ns]`` for a file, ``[path, -1]`` where there is nothing to read."""
    stamp: list[list[object]] = []
    for entry in sys.path:
        path = entry or os.getcwd()
        try:
            with os.scandir(path) as it:
                names = sorted(e.name for e in it if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:  # a zip file (its mtime covers its contents), missing or unreadable
            try:
                stamp.append([path, os.stat(path).st_mtime_ns])
            except OSError:
                stamp.append([path, -1])
            continue
        dirs: list[list[object]] = []
        for name in names:
            try:
                st = os.stat(os.path.join(path, name, "entry_points.txt"))
            except OSError:
                dirs.append([name])
                continue
            dirs.append([name, st.st_mtime_ns, st.st_size, st.st_ino])
        stamp.append([path, dirs])
    return stamp


def _cache_file(group: str) -> str:
    # os.path rather than pathlib: importing pathlib costs more than this whole module
    root = cache_root()
    # one file per interpreter, group and sys.path: `miles` (its bin directory first on sys.path)
    # and `python -m miles_core` (the working directory first) would otherwise rewrite one file
    # in turn, each start rescanning what the other just cached
    path = "\0".join(entry or os.getcwd() for entry in sys.path)
    key = zlib.adler32(f"{sys.executable}\0{group}\0{path}".encode()) & 0xFFFFFFFF
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
    payload = {"version": CACHE_VERSION, "stamp": stamp, "entry_points": [e._asdict() for e in found]}
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        write_bytes_atomic(cache, json.dumps(payload).encode())
    except OSError:
        pass  # a read-only home only costs the next run a rescan
    return found
