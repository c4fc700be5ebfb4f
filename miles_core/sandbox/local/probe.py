"""``verify()`` of the local provider: run one real sandbox and check what it promised.

The probe creates a sandbox in a scratch root with distinctive limits, then reads the limits
and network interfaces *from inside it* (``/proc/self/limits``, ``/proc/net/dev``), and, with
namespace isolation, its processes, capabilities, uid map and read-only root; it round-trips a
file, destroys the sandbox and checks nothing is left. Any mismatch raises, naming what differed.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from miles_core.sandbox.aio import run_sync
from miles_core.sandbox.base import Limits, SandboxSpec

PROBE_LIMITS = Limits(cpu_seconds=17, memory_mb=777, file_size_mb=13, processes=37, open_files=123)
#: /proc/self/limits row -> (Limits field, bytes per unit)
LIMIT_ROWS = {
    "Max cpu time": ("cpu_seconds", 1),
    "Max address space": ("memory_mb", 1 << 20),
    "Max file size": ("file_size_mb", 1 << 20),
    "Max processes": ("processes", 1),
    "Max open files": ("open_files", 1),
}
INSIDE = (
    "cat /proc/self/limits; echo ---; cat /proc/net/dev; echo ---; "
    "ls -d /proc/[0-9]* | wc -l; grep -E '^(CapEff|NoNewPrivs):' /proc/self/status; "
    "cat /proc/self/uid_map; touch /miles-probe 2>/dev/null && echo root-writable; true"
)


def probe(config: dict[str, Any] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="miles-sandbox-probe-") as root:
        os.chmod(root, 0o711)  # sandbox uids traverse it to reach their working directory
        return run_sync(_probe(Path(root), config or {}))


async def _probe(root: Path, config: dict[str, Any]) -> dict[str, Any]:
    from miles_core.sandbox.local.provider import LocalProvider

    started = time.perf_counter()
    provider = LocalProvider(root / "state", **config)
    try:
        ref = await provider.create(SandboxSpec(ttl_s=60, limits=PROBE_LIMITS))
        try:
            result = await provider.exec(ref, INSIDE, timeout=30)
            if not result.ok:
                raise RuntimeError(f"probe command failed (exit {result.exit_code}): {result.stderr.strip()}")
            limits_text, net_text, ns_text = result.stdout.split("---", 2)
            meta = provider.store.read_meta(ref.id)
            by_cgroup = {"memory_mb", "processes"} if meta is not None and meta.cgroup else set()
            enforced = _check_limits(limits_text, provider.capabilities.limits - by_cgroup)
            if by_cgroup and meta is not None and meta.cgroup:
                enforced.update(_check_cgroup(Path(meta.cgroup)))
            interfaces = sorted(re.findall(r"^\s*([^\s:]+):", net_text, re.M))
            if provider.capabilities.network_isolation and interfaces != ["lo"]:
                raise RuntimeError(f"network isolation claimed but the sandbox sees interfaces {interfaces}")
            inside = _check_namespaces(ns_text) if provider.isolation == "namespaces" else {}
            await provider.write_file(ref, "probe/file.txt", b"probe")
            if await provider.read_file(ref, "probe/file.txt") != b"probe":
                raise RuntimeError("file written into the sandbox did not read back")
        finally:
            await provider.destroy(ref.id)
        leftovers = await provider.list({})
        if leftovers or any((root / "state" / "sandboxes").iterdir()):
            raise RuntimeError(f"destroy left sandbox state behind: {[i.id for i in leftovers]}")
    finally:
        await provider.aclose()
    return {
        **provider.describe(),
        "capabilities": provider.capabilities.to_dict(),
        "limits_seen_inside": enforced,
        "interfaces_inside": interfaces,
        **({"seen_inside": inside} if inside else {}),
        "probe_ms": round((time.perf_counter() - started) * 1000, 1),
    }


def _check_namespaces(text: str) -> dict[str, Any]:
    """What a namespace sandbox must look like from inside: a handful of its own processes, no
    capabilities, no_new_privs, one mapped uid, a read-only root."""
    lines = text.split()
    processes = int(lines[0])
    if processes > 8:
        raise RuntimeError(f"namespace isolation claimed but the sandbox sees {processes} processes")
    status = dict(re.findall(r"^(CapEff|NoNewPrivs):\s*(\S+)", text, re.M))
    if status.get("CapEff") != "0000000000000000" or status.get("NoNewPrivs") != "1":
        raise RuntimeError(f"sandboxed commands hold privileges: {status}")
    maps = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s*$", text, re.M)
    if len(maps) != 1 or maps[0][2] != "1":
        raise RuntimeError(f"the sandbox's user namespace maps more than one uid: {maps}")
    if "root-writable" in text:
        raise RuntimeError("the sandbox's root filesystem is writable")
    return {"processes": processes, "uid_map": " ".join(maps[0]), **status}


def _check_cgroup(path: Path) -> dict[str, int]:
    """Memory and process limits of a sandbox's cgroup, as the kernel reports them."""
    from miles_core.sandbox.local.cgroups import read_limits

    found = read_limits(path)
    expected = {"memory.max": str(PROBE_LIMITS.memory_mb << 20), "pids.max": str(PROBE_LIMITS.processes)}
    for name, value in expected.items():
        if found.get(name) != value:
            raise RuntimeError(f"cgroup {path}: {name} is {found.get(name)!r}, expected {value}")
    return {"memory_mb": PROBE_LIMITS.memory_mb, "processes": PROBE_LIMITS.processes}


def _check_limits(text: str, declared: frozenset[str] | set[str]) -> dict[str, int]:
    seen: dict[str, int] = {}
    for row, (field, unit) in LIMIT_ROWS.items():
        match = re.search(rf"^{row}\s+(\S+)\s+(\S+)", text, re.M)
        if match is None or field not in declared:
            continue
        expected = getattr(PROBE_LIMITS, field) * unit
        soft = match.group(1)
        if soft != str(expected):
            raise RuntimeError(f"limit {field}: the sandbox sees {soft}, expected {expected}")
        seen[field] = int(soft) // unit
    missing = declared - set(seen)
    if missing:
        raise RuntimeError(f"declared limits not visible inside the sandbox: {sorted(missing)}")
    return seen
