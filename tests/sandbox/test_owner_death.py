"""SIGKILL of the owning process: beats stop, and the local provider's TTL reclaims its
sandboxes -- directories, uid claims and every process started in them -- in each isolation mode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.local.isolation import sandbox_processes
from miles_core.sandbox.local.store import Store
from miles_core.sandbox.ownership import process_alive

register_cpu_ci(est_time=30, suite="stage-a-cpu")

TTL = 2.0
OWNER = textwrap.dedent(
    """
    import asyncio, json, sys
    from miles_core.sandbox.base import SandboxSpec
    from miles_core.sandbox.lifecycle import SandboxManager
    from miles_core.sandbox.local.provider import LocalProvider

    async def main():
        provider = LocalProvider(sys.argv[1], **json.loads(sys.argv[3]))
        manager = SandboxManager(provider)
        boxes = [await manager.create(SandboxSpec(ttl_s=float(sys.argv[2]))) for _ in range(3)]
        for box in boxes:
            await box.exec(["sleep", "600"], background=True)
        client = await provider._client()
        print(json.dumps({"ids": [b.id for b in boxes], "supervisor": client.pid}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def _pids_of_uid(uid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(f"/proc/{entry.name}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                found.append(int(entry.name))  # a zombie has ended; only its parent has not reaped it yet
    return found


def test_ttl_reclaims_after_owner_sigkill(sandbox_root: Path, local_options) -> None:  # type: ignore[no-untyped-def]
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(sandbox_root), str(TTL), json.dumps(local_options)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        started = json.loads(owner.stdout.readline())  # type: ignore[union-attr]
        store = Store(sandbox_root)
        ids = started["ids"]
        metas = {m.id: m for m in store.metas()}
        assert set(metas) == set(ids)
        assert all(sandbox_processes(sid) for sid in ids), {sid: sandbox_processes(sid) for sid in ids}
        time.sleep(2 * TTL)  # past the TTL: only the owner's keepalive keeps them
        assert {m.id for m in store.metas()} == set(ids), "keepalive did not hold the sandboxes"
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        killed_at = time.monotonic()
        while store.metas():
            assert time.monotonic() - killed_at < TTL + 10, "the TTL did not reclaim the sandboxes"
            time.sleep(0.1)
        for sid in ids:
            assert sandbox_processes(sid) == [], f"processes of {sid} survived"
            assert not store.sandbox_dir(sid).exists()
        for meta in metas.values():
            if meta.uid is not None:
                assert _pids_of_uid(meta.uid) == [], f"uid {meta.uid} of {meta.id} still has processes"
        if store.registry is not None:
            assert store.registry.claims(store.root) == []
        deadline = time.monotonic() + 10
        # it exits once idle; its parent (the owner) is gone, so a reaper that never waits, as in
        # some containers, may leave it a zombie, which has exited too
        while process_alive(started["supervisor"], None):
            assert time.monotonic() < deadline, "the supervisor did not exit after reclaiming"
            time.sleep(0.1)
    finally:
        if owner.poll() is None:
            owner.kill()


def test_namespace_sandboxes_end_with_their_supervisor(sandbox_root: Path, namespace_options) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL of the supervisor itself (no TTL keeper left): every namespace sandbox ends at once,
    and the next supervisor removes what is left on disk."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(sandbox_root), "600", json.dumps(namespace_options)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        started = json.loads(owner.stdout.readline())  # type: ignore[union-attr]
        store = Store(sandbox_root)
        inits = [(m.init_pid, m.init_start) for m in store.metas()]
        assert len(inits) == 3 and all(process_alive(p, s) for p, s in inits if p)
        os.kill(started["supervisor"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(process_alive(p, s) for p, s in inits if p) or any(sandbox_processes(i) for i in started["ids"]):
            assert time.monotonic() < deadline, "namespace sandboxes outlived their supervisor"
            time.sleep(0.05)
    finally:
        owner.kill()
        owner.wait()
    from miles_core.sandbox.local.provider import LocalProvider

    async def sweep_on_start() -> None:  # a new supervisor reaps sandboxes whose supervisor died
        provider = LocalProvider(sandbox_root, **namespace_options)
        try:
            await provider._client()
        finally:
            await provider.aclose()

    import asyncio

    for meta in store.metas():
        meta.expires_at = 0.0  # reaped at start: past their deadline, supervisor gone
        store.write_meta(meta)
    asyncio.run(sweep_on_start())
    assert store.metas() == [] and list((sandbox_root / "sandboxes").iterdir()) == []
