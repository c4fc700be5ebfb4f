"""Keep ``est_time`` honest: propose values from measured durations and rewrite them in place.

Measurements come from JUnit reports (``miles ci run --junit``, or plain pytest ``--junitxml``).
Only passing runs count; a file's proposal is the median of its measured wall times rounded up to
a whole second. A proposal is a change when it differs from the current literal by more than the
tolerance. Rewriting replaces exactly the ``est_time`` literal's characters, so formatting and
comments around it are untouched.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles_core.ci.catalog import Catalog
from miles_core.ci.discovery import Registration
from miles_core.ci.junit import Measurement
from miles_core.errors import ConfigError, MilesError
from miles_core.fileio import write_bytes_atomic


@dataclass(frozen=True)
class Proposal:
    registration: Registration
    measured: float
    runs: int
    proposed: float
    changed: bool


def _resolve_dotted(module: str, files: Sequence[str]) -> str | None:
    """The test file a pytest class name (``tests.ci.test_x.TestK``, relative to the rootdir)
    belongs to: the longest registered file whose dotted path prefixes it."""
    matches = [
        file
        for file in files
        if module == (dotted := file.removesuffix(".py").replace("/", ".")) or module.startswith(dotted + ".")
    ]
    return max(matches, key=len, default=None)


def propose(
    catalog: Catalog,
    measurements: Sequence[Measurement],
    *,
    hardware: str | None = None,
    tolerance: float = 0.25,
) -> tuple[list[Proposal], list[str]]:
    """Proposals per registration, and notes about measurements that could not be used."""
    if hardware is not None:
        catalog.kind(hardware)
    notes: list[str] = []
    per_run: dict[tuple[str, str, str | None, str | None], float] = defaultdict(float)
    for m in measurements:
        file = _resolve_dotted(m.file, catalog.files) if m.dotted else m.file
        if file is None or file not in catalog.files:
            notes.append(f"{m.source}: {m.file} is not a registered test file; ignored")
            continue
        if m.status != "passed":
            notes.append(f"{m.source}: {file} {m.status} after {m.seconds:.1f} s; not used as a measurement")
            continue
        per_run[(m.source, file, m.hardware, m.suite)] += m.seconds
    samples: dict[Registration, list[float]] = defaultdict(list)
    for (source, file, m_hardware, m_suite), seconds in per_run.items():
        want = m_hardware or hardware
        candidates = [
            r
            for r in catalog.registrations
            if r.path == file and r.enabled and want in (None, r.hardware) and m_suite in (None, r.suite)
        ]
        if len(candidates) != 1:
            kinds = sorted({r.hardware for r in candidates})
            notes.append(
                f"{source}: {file} has {len(candidates)} matching registrations ({', '.join(kinds) or 'none enabled'}); "
                "pass --hw to say which hardware measured it"
            )
            continue
        samples[candidates[0]].append(seconds)
    proposals = []
    for reg in sorted(samples, key=lambda r: (r.path, r.line)):
        measured = statistics.median(samples[reg])
        proposed = float(max(1, math.ceil(measured)))
        changed = abs(proposed - reg.est_time) > tolerance * reg.est_time and proposed != reg.est_time
        proposals.append(Proposal(reg, measured, len(samples[reg]), proposed, changed))
    return proposals, notes


def _literal(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def rewrite(root: Path, proposals: Sequence[Proposal]) -> list[str]:
    """Rewrite the ``est_time`` literal of each changed proposal; return the files written.

    Every file is checked before any is written, so a stale span changes nothing."""
    by_file: dict[str, list[Proposal]] = defaultdict(list)
    for p in proposals:
        if p.changed:
            by_file[p.registration.path].append(p)
    new_texts: dict[Path, bytes] = {}
    for rel, items in sorted(by_file.items()):
        path = root / rel
        lines = path.read_bytes().splitlines(keepends=True)
        for p in sorted(items, key=lambda p: p.registration.est_span, reverse=True):
            line, col, end_line, end_col = p.registration.est_span
            current = lines[line - 1][col:end_col] if line == end_line else b""
            try:
                still_there = float(current.decode()) == p.registration.est_time
            except ValueError:
                still_there = False
            if not still_there:
                raise MilesError(
                    f"{rel}:{line}: est_time literal changed since it was read; run est-times again"
                )
            lines[line - 1] = (
                lines[line - 1][:col] + _literal(p.proposed).encode() + lines[line - 1][end_col:]
            )
        new_texts[path] = b"".join(lines)
    for path, data in new_texts.items():
        write_bytes_atomic(path, data)
    return sorted(by_file)


def check_tolerance(tolerance: float) -> float:
    if not 0 <= tolerance < 10:
        raise ConfigError(f"--tolerance must be between 0 and 10 (a fraction of est_time), got {tolerance}")
    return tolerance
