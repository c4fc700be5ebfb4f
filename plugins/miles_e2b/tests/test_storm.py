"""Cancellation storm on the fake E2B service: 1,000 creates cancelled at random points at
concurrency 64 leave nothing behind by listing, and the service never sees more than 64 creates
at once. A naive ``wait_for(provider.create(...))`` leaks on the same fake (negative control)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from miles_e2b.fake import FakeE2BServer
from miles_e2b.provider import E2BProvider

from miles_core.ci.register import register_cpu_ci
from miles_core.testing.sandbox import cancellation_storm, naive_create_leaks

register_cpu_ci(est_time=8, suite="stage-a-cpu")

LIMIT = 64


def test_storm_leaves_nothing_and_respects_the_limit(
    server: FakeE2BServer, make_provider: Callable[..., E2BProvider]
) -> None:
    server.create_latency_s = 0.004

    async def main():  # type: ignore[no-untyped-def]
        provider = make_provider()
        report = await cancellation_storm(provider, creates=1000, limit=LIMIT, seed=3)
        return report, await provider.list({})

    report, listed = asyncio.run(main())
    summary = report.to_dict()
    assert report.left_behind == [] and listed == [] and server.sandboxes == {}, summary
    assert server.max_in_flight_creates <= LIMIT and report.max_in_flight <= LIMIT, summary
    assert (
        report.cancelled_in_create > 50 and report.cancelled_waiting > 50 and report.completed_for_caller > 0
    ), summary


def test_naive_cancellation_leaks_negative_control(
    server: FakeE2BServer, make_provider: Callable[..., E2BProvider]
) -> None:
    server.create_latency_s = 0.004
    leaked = asyncio.run(naive_create_leaks(make_provider(), creates=100, max_delay_s=0.006, seed=3))
    assert leaked > 5
