"""Cancellation storm: 1,000 creates cancelled at random points leave nothing behind and never
exceed the concurrency limit -- against the in-memory double and the real local provider.
A naive ``wait_for(provider.create(...))`` is the negative control: it leaks."""

from __future__ import annotations

import asyncio
from pathlib import Path

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.local.provider import LocalProvider
from miles_core.testing.sandbox import InMemoryProvider, cancellation_storm, naive_create_leaks

register_cpu_ci(est_time=12, suite="stage-a-cpu")

LIMIT = 8


def _check(report) -> None:  # type: ignore[no-untyped-def]
    summary = report.to_dict()
    assert report.left_behind == [], summary
    assert report.max_in_flight <= LIMIT, summary
    # the storm must actually hit every phase, or it proves nothing
    assert report.cancelled_in_create > 50 and report.cancelled_waiting > 50, summary
    assert report.completed_for_caller > 0, summary


def test_storm_in_memory() -> None:
    provider = InMemoryProvider(create_delay_s=0.004)
    report = asyncio.run(cancellation_storm(provider, creates=1000, limit=LIMIT, seed=1, max_delay_s=0.012))
    _check(report)
    assert provider.live == {}


def test_naive_cancellation_leaks_negative_control() -> None:
    provider = InMemoryProvider(create_delay_s=0.004)
    assert asyncio.run(naive_create_leaks(provider, creates=200, max_delay_s=0.006, seed=1)) > 10


def test_storm_local(sandbox_root: Path) -> None:
    async def main():  # type: ignore[no-untyped-def]
        provider = LocalProvider(sandbox_root)
        try:
            return await cancellation_storm(provider, creates=1000, limit=LIMIT, seed=2)
        finally:
            await provider.aclose()

    report = asyncio.run(main())
    _check(report)
    leftovers = list((sandbox_root / "sandboxes").iterdir()) + list((sandbox_root / "uids").iterdir())
    assert leftovers == [], leftovers
