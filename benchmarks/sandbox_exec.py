"""Local sandbox exec round trip vs a bare ``subprocess.run`` of the same command, and 64
concurrent sandboxes. Prints one JSON line.

* ``ratio``: median sandbox exec / median bare run of a reward-sized command (a short Python
  program, what rewards that execute model output run), in the isolation mode measured
  (default: namespaces, with the tool the provider picks); target <= 2.0.
* ``trivial``: the same for ``true``, whose runtime is ~0: its ``overhead_ms`` is the fixed
  cost per exec (supervisor round trip; a fork that joins the sandbox's namespaces through a
  pidfd, sets limits, drops privileges and forks once more into its pid namespace).
* ``concurrent``: 64 sandboxes created, each running the command at once, then destroyed.

Both sides run the same binary by absolute path, interleaved run by run. The line records the
1-minute load average before and after.

Usage: ``python benchmarks/sandbox_exec.py [--runs N] [--sandboxes 64] [-o KEY=VALUE ...]``
(``-o isolation=process``, ``-o namespace_tool=unshare``: provider options)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from miles_core.sandbox.base import SandboxSpec
from miles_core.sandbox.lifecycle import Sandbox, SandboxManager
from miles_core.sandbox.local.images import DEFAULT_PATH
from miles_core.sandbox.local.provider import LocalProvider
from miles_core.sandbox.local.store import remove_tree

# absolute paths, resolved with the sandbox's PATH: both sides must run the same binaries
PYTHON = shutil.which("python3", path=DEFAULT_PATH) or "/usr/bin/python3"
REWARD_CMD = [PYTHON, "-c", "print(sum(i * i for i in range(10000)))"]
TRIVIAL_CMD = [shutil.which("true", path=DEFAULT_PATH) or "/bin/true"]


def bare_ms(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    return (time.perf_counter() - started) * 1000


async def sandbox_ms(box: Sandbox, cmd: list[str]) -> float:
    started = time.perf_counter()
    result = await box.exec(cmd)
    elapsed = (time.perf_counter() - started) * 1000
    if not result.ok:
        raise RuntimeError(f"{cmd} failed in the sandbox: {result}")
    return elapsed


async def compare(box: Sandbox, cmd: list[str], runs: int) -> dict[str, float]:
    bare, boxed = [], []
    for _ in range(3):  # warm both paths
        bare_ms(cmd)
        await sandbox_ms(box, cmd)
    for _ in range(runs):  # interleaved: machine noise hits both alike
        bare.append(bare_ms(cmd))
        boxed.append(await sandbox_ms(box, cmd))
    b, s = statistics.median(bare), statistics.median(boxed)
    return {
        "bare_ms": round(b, 3),
        "sandbox_ms": round(s, 3),
        "ratio": round(s / b, 3),
        "overhead_ms": round(s - b, 3),
    }


async def concurrent(manager: SandboxManager, count: int) -> dict[str, object]:
    started = time.perf_counter()
    created = await asyncio.gather(
        *(manager.create(SandboxSpec(ttl_s=300)) for _ in range(count)), return_exceptions=True
    )
    boxes = [b for b in created if isinstance(b, Sandbox)]
    results = await asyncio.gather(*(b.exec(REWARD_CMD, timeout=120) for b in boxes), return_exceptions=True)
    expected = f"{sum(i * i for i in range(10000))}\n"
    errors = [repr(r) for r in created if not isinstance(r, Sandbox)]
    errors += [repr(r) for r in results if isinstance(r, BaseException) or not r.ok or r.stdout != expected]
    await asyncio.gather(*(manager.destroy(b) for b in boxes))
    left = await manager.provider.list({"miles.owner": manager.owner.run_id})
    return {
        "sandboxes": count,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "left_behind": len(left),
        "seconds": round(time.perf_counter() - started, 3),
        "cpus": os.cpu_count(),
    }


async def main(runs: int, sandboxes: int, root: Path, options: dict[str, str]) -> dict[str, object]:
    load_before = os.getloadavg()[0]
    provider = LocalProvider(root, **options)  # type: ignore[arg-type]
    try:
        async with SandboxManager(provider, max_concurrent_creates=16) as manager:
            box = await manager.create(SandboxSpec(ttl_s=300))
            reward = await compare(box, REWARD_CMD, runs)
            trivial = await compare(box, TRIVIAL_CMD, runs)
            await box.destroy()
            many = await concurrent(manager, sandboxes)
    finally:
        await provider.aclose()
    return {
        "benchmark": "sandbox_exec",
        "command": " ".join(REWARD_CMD),
        "ratio": reward["ratio"],
        "target": 2.0,
        **{k: v for k, v in reward.items() if k != "ratio"},
        "isolation": provider.isolation,
        "tool": provider.tool,
        "network_isolation": provider.capabilities.network_isolation,
        "trivial": {"command": "true", **trivial},
        "concurrent": many,
        "runs": runs,
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--sandboxes", type=int, default=64)
    parser.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    options = dict(item.split("=", 1) for item in args.options)
    scratch = Path(tempfile.mkdtemp(prefix="miles-bench-"))
    os.chmod(scratch, 0o711)
    try:
        print(json.dumps(asyncio.run(main(args.runs, args.sandboxes, scratch / "state", options))))
    finally:
        remove_tree(scratch)
