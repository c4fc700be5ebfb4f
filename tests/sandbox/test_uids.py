"""Per-sandbox uids: one registry per host, shared by every miles process and state root."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.base import SandboxSpec
from miles_core.sandbox.errors import SandboxCapacityError
from miles_core.sandbox.local import uids
from miles_core.sandbox.local.isolation import is_root
from miles_core.sandbox.local.provider import LocalProvider
from miles_core.sandbox.local.uids import Claim, UidRegistry

register_cpu_ci(est_time=4, suite="stage-a-cpu")

CLAIMER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from miles_core.sandbox.local.uids import UidRegistry
    registry = UidRegistry(Path(sys.argv[1]))
    root = Path(sys.argv[2])
    print(json.dumps([registry.claim(root, f"box{i}") for i in range(int(sys.argv[3]))]), flush=True)
    sys.stdin.read()  # stay alive: a claim of a process that is gone (and has no sandbox) is stale
    """
)


def test_processes_with_different_roots_never_share_a_uid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = tmp_path / "registry"
    UidRegistry(registry)
    monkeypatch.setattr(uids, "UID_SLOTS", 256)  # crowd them: collisions are likely without the lock
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    crowded = "from miles_core.sandbox.local import uids; uids.UID_SLOTS = 256\n"
    script = CLAIMER.replace("from miles_core.sandbox.local.uids import UidRegistry", crowded + "UidRegistry = uids.UidRegistry")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(registry), str(tmp_path / f"root{n}"), "100"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in range(2)
    ]
    claimed = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    for p in procs:
        p.communicate(timeout=120)
    assert all(p.returncode == 0 for p in procs)
    every = claimed[0] + claimed[1]
    assert len(set(every)) == len(every) == 200
    held = UidRegistry(registry).claims()
    assert sorted(c.uid for c in held) == sorted(every)
    assert {c.root for c in held} == {str(tmp_path / "root0"), str(tmp_path / "root1")}
    # now both claimers are gone and hold no sandbox: their claims are stale, every slot is free
    again = UidRegistry(registry)
    assert len({again.claim(tmp_path / "root2", f"new{i}") for i in range(256)}) == 256
    with pytest.raises(SandboxCapacityError):
        again.claim(tmp_path / "root2", "one-too-many")


def test_release_and_stale_claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uids, "UID_SLOTS", 2)
    registry = UidRegistry(tmp_path / "registry")
    root = tmp_path / "root"
    first, second = registry.claim(root, "a"), registry.claim(root, "b")
    assert {first, second} == {uids.UID_BASE, uids.UID_BASE + 1}
    with pytest.raises(SandboxCapacityError):  # both held by this live process
        registry.claim(root, "c")
    registry.release(first, tmp_path / "other-root", "a")  # not the holder: kept
    assert len(registry.claims()) == 2
    registry.release(first, root, "a")
    assert registry.claim(root, "c") == first
    dead = Claim(second, str(root), "b", 2**22 + 7, "", 0.0)  # claimer gone, no sandbox, no process
    (registry.path / str(second)).write_text(json.dumps(dead.__dict__))
    registry.release(first, root, "c")
    assert sorted([registry.claim(root, "d"), registry.claim(root, "e")]) == sorted([first, second])


def test_the_registry_must_be_private(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(Exception, match="writable by it alone"):
        UidRegistry(shared)


@pytest.mark.skipif(not is_root(), reason="per-sandbox uids need root")
def test_two_state_roots_claim_from_one_registry(sandbox_root: Path) -> None:
    async def main() -> list[int]:
        providers = [LocalProvider(sandbox_root.parent / f"state{n}") for n in range(2)]
        try:
            refs = [await p.create(SandboxSpec()) for p in providers for _ in range(3)]
            found = [m.uid for p in providers for m in p.store.metas()]
            for ref, provider in zip(refs, [p for p in providers for _ in range(3)], strict=True):
                await provider.destroy(ref.id)
            for provider in providers:
                assert provider.store.registry is not None
                assert provider.store.registry.claims(provider.store.root) == []
            return [uid for uid in found if uid is not None]
        finally:
            for provider in providers:
                await provider.aclose()

    found = asyncio.run(main())
    assert len(found) == 6 and len(set(found)) == 6
