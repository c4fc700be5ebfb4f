"""Namespace sandboxes never lean on the host's init: nothing of theirs is handed to it to reap.

A sandbox's init finishes exiting only once every process of its pid namespace has been reaped,
so a zombie left to the host's init holds up its destroy for as long as that init takes: seconds
on a loaded machine, forever under an init that never reaps (some containers). Here the owner
runs as a child subreaper that never reaps, which stands in for such an init: every process
orphaned below it becomes its zombie, and a destroy that waited for one would time out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=8, suite="stage-a-cpu")

#: makes this process the reaper of its orphaned descendants; ``adopted()`` lists them
NEVER_REAPS = textwrap.dedent(
    """
    import ctypes, os
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")

    def adopted(*own):
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in own:
                continue
            try:
                stat = open(f"/proc/{entry.name}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == os.getpid():
                found.append(stat[: stat.rindex(")") + 3])
        return found
    """
)

PROVIDER = NEVER_REAPS + textwrap.dedent(
    """
    import asyncio, json, sys, time
    from miles_core.sandbox.base import SandboxSpec
    from miles_core.sandbox.local.provider import LocalProvider

    async def main():
        provider = LocalProvider(sys.argv[1], **json.loads(sys.argv[2]))
        ref = await provider.create(SandboxSpec())
        supervisor = (await provider._client()).pid
        timed_out = [(await provider.exec(ref, "sleep 30", timeout=0.2)).timed_out for _ in range(6)]
        cancelled = asyncio.ensure_future(provider.exec(ref, "sleep 30"))
        await asyncio.sleep(0.3)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        await provider.exec(ref, "sleep 30", background=True)
        await asyncio.sleep(0.3)  # the cancelled command is killed after its cancel arrives
        orphans = adopted(supervisor)
        started = time.monotonic()
        error = None
        try:
            await provider.destroy(ref.id)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - started
        await provider.aclose()
        print(json.dumps({"timed_out": timed_out, "orphans": orphans, "destroy_error": error,
                          "destroy_s": took, "left": adopted()}))

    asyncio.run(main())
    """
)

CLI = NEVER_REAPS + textwrap.dedent(
    """
    import json, sys
    from miles_core.cli import main

    codes = []
    for _ in range(4):
        try:
            main(["sandbox", "run", *sys.argv[1:]])
        except SystemExit as exc:
            codes.append(exc.code)
    print(json.dumps({"codes": codes, "left": adopted()}))
    """
)


def _run(script: str, *argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_ended_commands_leave_nothing_to_the_hosts_init(sandbox_root: Path, namespace_options) -> None:  # type: ignore[no-untyped-def]
    """Timed out, cancelled and background commands: none is handed to the host's init, and the
    destroy after them is immediate."""
    report = _run(PROVIDER, str(sandbox_root), json.dumps(namespace_options))
    assert report["timed_out"] == [True] * 6
    assert report["orphans"] == [], "commands were orphaned to the host's init"
    assert report["destroy_error"] is None
    assert report["destroy_s"] < 5, report
    assert report["left"] == []


def test_cli_timeout_exits_124_under_an_init_that_never_reaps(sandbox_root: Path, namespace_options) -> None:  # type: ignore[no-untyped-def]
    """`miles sandbox run --timeout`: 124, not an error from a destroy stuck behind a zombie."""
    options = [arg for key, value in namespace_options.items() for arg in ("-o", f"{key}={value}")]
    env = {**os.environ, "MILES_SANDBOX_ROOT": str(sandbox_root)}
    report = _run(CLI, *options, "--timeout", "0.3", "--", "sleep", "10", env=env)
    assert report == {"codes": [124] * 4, "left": []}, report
