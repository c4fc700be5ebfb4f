"""cgroup v2 limits of namespace sandboxes: which parent is usable and why, the limit files of a
sandbox's cgroup, and -- where this host delegates one -- the limits enforced on the whole
sandbox (skipped on cgroup v1 hosts and without a delegated cgroup, with the reason)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.base import Limits, SandboxSpec
from miles_core.sandbox.errors import SandboxUnsupported
from miles_core.sandbox.local import cgroups
from miles_core.sandbox.local.provider import LocalProvider

register_cpu_ci(est_time=1, suite="stage-a-cpu")


@pytest.fixture
def fake_hierarchy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory standing in for the cgroup v2 mount (only the file protocol is exercised)."""
    monkeypatch.setattr(cgroups, "cgroup2_mount", lambda: tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    return tmp_path


def test_a_parent_must_delegate_memory_and_pids(fake_hierarchy: Path) -> None:
    parent = fake_hierarchy / "delegated"
    parent.mkdir()
    (parent / "cgroup.subtree_control").write_text("memory\n")
    found, why = cgroups.find_parent(str(parent))
    assert found is None and "does not enable ['pids']" in why
    (parent / "cgroup.subtree_control").write_text("cpu memory pids\n")
    found, why = cgroups.find_parent(str(parent))
    assert found is not None and found.controllers == {"cpu", "memory", "pids"}
    outside, why = cgroups.find_parent("/tmp")
    assert outside is None and "not inside the cgroup v2 hierarchy" in why
    assert cgroups.find_parent("none") == (None, "cgroups off (option cgroup=none)")


def test_a_sandbox_cgroup_holds_its_limits(fake_hierarchy: Path) -> None:
    parent = cgroups.CgroupParent(fake_hierarchy, frozenset({"cpu", "memory", "pids"}))
    path = cgroups.create(parent, "abc123", memory_mb=300, processes=40, cpus=1.5)
    assert cgroups.read_limits(path) == {"memory.max": str(300 << 20), "pids.max": "40", "cpu.max": "150000 100000"}
    for name in ("memory.max", "pids.max", "cpu.max"):
        (path / name).unlink()  # a real cgroup's files vanish with it; rmdir needs it empty here
    cgroups.remove(path)
    assert not path.exists()


def test_an_unusable_cgroup_option_is_refused(sandbox_root: Path, tmp_path: Path, namespace_options) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SandboxUnsupported, match="cannot hold sandboxes"):
        LocalProvider(sandbox_root, cgroup=str(tmp_path), **namespace_options)


def test_cgroup_limits_cover_the_whole_sandbox(sandbox_root: Path, namespace_options) -> None:  # type: ignore[no-untyped-def]
    parent, why = cgroups.find_parent(None)
    if parent is None:
        pytest.skip(f"no usable cgroup v2 parent here: {why}")

    async def main() -> None:
        provider = LocalProvider(sandbox_root, **namespace_options)
        try:
            ref = await provider.create(SandboxSpec(limits=Limits(memory_mb=128, processes=16)))
            meta = provider.store.read_meta(ref.id)
            assert meta is not None and meta.cgroup is not None
            assert cgroups.read_limits(Path(meta.cgroup))["pids.max"] == "16"
            hog = await provider.exec(ref, ["python3", "-c", "b = bytearray(512 << 20); b[::4096] = b'x' * len(b[::4096])"], timeout=60)
            assert not hog.ok, hog
            forks = await provider.exec(ref, "n=0; while [ $n -lt 64 ]; do sleep 5 & echo f; n=$((n+1)); done", timeout=60)
            assert forks.stdout.count("f") < 16, forks
            await provider.destroy(ref.id)
            assert not Path(meta.cgroup).exists()
        finally:
            await provider.aclose()

    asyncio.run(main())
