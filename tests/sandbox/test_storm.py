"""Cancellation storm: 1,000 creates cancelled at random points at concurrency 64 leave nothing
behind -- no sandbox, directory, uid claim or process -- and never exceed the concurrency limit,
against the in-memory double and the real local provider in each isolation mode. A naive
``wait_for(provider.create(...))`` is the negative control: it leaks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.base import SandboxRef, SandboxSpec
from miles_core.sandbox.local.provider import LocalProvider
from miles_core.sandbox.ownership import process_alive
from miles_core.testing.sandbox import InMemoryProvider, cancellation_storm, naive_create_leaks

register_cpu_ci(est_time=20, suite="stage-a-cpu")

LIMIT = 64


def _check(report, creates: int = 1000) -> None:  # type: ignore[no-untyped-def]
    summary = report.to_dict()
    assert report.creates == creates
    assert report.left_behind == [], summary
    assert report.max_in_flight <= LIMIT, summary
    # the storm must actually hit every phase, or it proves nothing
    assert report.cancelled_in_create > creates // 20 and report.cancelled_waiting > creates // 20, summary
    assert report.completed_for_caller > 0, summary


def test_storm_in_memory() -> None:
    provider = InMemoryProvider(create_delay_s=0.004)
    # the delays follow the measured create time (3x), so every phase is hit whatever the load
    report = asyncio.run(cancellation_storm(provider, creates=1000, limit=LIMIT, seed=1))
    _check(report)
    assert provider.live == {}


def test_naive_cancellation_leaks_negative_control() -> None:
    provider = InMemoryProvider(create_delay_s=0.004)
    assert asyncio.run(naive_create_leaks(provider, creates=200, max_delay_s=0.006, seed=1)) > 10


class Recording(LocalProvider):
    """Remembers every process a create started (a namespace sandbox's init and its keeper)."""

    started: list[tuple[int, str | None]]

    async def create(self, spec: SandboxSpec) -> SandboxRef:
        ref = await super().create(spec)
        meta = self.store.read_meta(ref.id)
        assert meta is not None
        for pid, start in ((meta.init_pid, meta.init_start), (meta.keeper_pid, meta.keeper_start)):
            if pid is not None:
                self.started.append((pid, start))
        return ref


def _storm(root: Path, options: dict[str, Any], creates: int) -> None:
    async def main():  # type: ignore[no-untyped-def]
        provider = Recording(root, **options)
        provider.started = []
        try:
            report = await cancellation_storm(provider, creates=creates, limit=LIMIT, seed=2)
            supervisor = (await provider._client()).pid
            children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
            return report, provider, children
        finally:
            await provider.aclose()

    report, provider, children = asyncio.run(main())
    _check(report, creates)
    assert list((root / "sandboxes").iterdir()) == []
    if provider.store.registry is not None:
        assert provider.store.registry.claims(provider.store.root) == []
    assert children == [], f"the supervisor still has children: {children}"
    alive = [pid for pid, start in provider.started if process_alive(pid, start)]
    assert alive == [], f"processes of destroyed sandboxes are alive: {alive}"
    if options.get("isolation") == "namespaces":
        assert len(provider.started) >= 2 * report.cancelled_in_create  # every real create had an init


def test_storm_local_namespaces(sandbox_root: Path, namespace_options) -> None:  # type: ignore[no-untyped-def]
    _storm(sandbox_root, namespace_options, 1000)


def test_storm_local_process(sandbox_root: Path) -> None:
    _storm(sandbox_root, {"isolation": "process"}, 300)
