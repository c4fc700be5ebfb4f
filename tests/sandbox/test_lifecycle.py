"""The lifecycle layer against an in-memory provider: retries, slots, keepalive, images, sweep."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.base import (
    LABEL_CREATE,
    LABEL_HOST,
    LABEL_MANAGED,
    LABEL_OWNER,
    LABEL_PID,
    LABEL_PID_START,
    ImageSpec,
    Run,
    SandboxInfo,
    SandboxSpec,
)
from miles_core.sandbox.errors import (
    ImageBuildError,
    SandboxCapacityError,
    SandboxFatalError,
    SandboxThrottled,
    SandboxTransientError,
)
from miles_core.sandbox.lifecycle import SandboxManager
from miles_core.sandbox.ownership import Owner, orphan_reason, process_start_time, sweep
from miles_core.sandbox.retry import RetryPolicy
from miles_core.testing.sandbox import CountingProvider, InMemoryProvider

register_cpu_ci(est_time=4, suite="stage-a-cpu")

FAST = RetryPolicy(attempts=3, base_s=0.001, cap_s=0.004)


def test_create_stamps_owner_labels_and_one_create_id() -> None:
    async def main() -> None:
        provider = InMemoryProvider(failures=[SandboxTransientError("blip")])
        async with SandboxManager(provider, retry=FAST) as manager:
            box = await manager.create(SandboxSpec(labels={"task": "t1"}))
            labels = box.labels
            assert labels["task"] == "t1" and labels[LABEL_MANAGED] == "1"
            assert labels[LABEL_OWNER] == manager.owner.run_id
            assert labels[LABEL_PID] == str(os.getpid()) and labels[LABEL_HOST] == socket.gethostname()
            assert len(labels[LABEL_CREATE]) == 32
        assert provider.live == {}  # leaving the manager destroyed it

    asyncio.run(main())


@pytest.mark.parametrize(
    ("failures", "calls", "raises"),
    [
        ([SandboxThrottled("429"), SandboxCapacityError("full")], 3, None),
        ([SandboxFatalError("bad key")], 1, SandboxFatalError),
        ([SandboxThrottled("429")] * 5, 3, SandboxThrottled),
    ],
    ids=["retryable-then-ok", "fatal-at-once", "budget-exhausted"],
)
def test_create_retries_only_retryable_errors(failures: list, calls: int, raises: type | None) -> None:
    async def main() -> None:
        provider = InMemoryProvider(failures=list(failures))
        async with SandboxManager(provider, retry=FAST) as manager:
            if raises is None:
                await manager.create()
            else:
                with pytest.raises(raises):
                    await manager.create()
        assert provider.calls.count("create") == calls

    asyncio.run(main())


def test_backoff_is_jittered_within_bounds_and_honours_retry_after() -> None:
    policy = RetryPolicy(attempts=10, base_s=1.0, cap_s=8.0)
    rng = random.Random(0)
    error = SandboxTransientError("x")
    for attempt, ceiling in [(0, 1.0), (1, 2.0), (2, 4.0), (5, 8.0)]:
        delays = [policy.delay(attempt, error, rng) for _ in range(200)]
        assert min(delays) >= ceiling / 2 and max(delays) <= ceiling
        assert len(set(delays)) > 150  # jittered, not constant
    throttled = SandboxThrottled("slow down", retry_after=3.0)
    assert all(3.0 <= policy.delay(0, throttled, rng) <= 3.75 for _ in range(50))


def test_cancelled_create_holds_its_slot_until_the_real_create_ends() -> None:
    async def main() -> None:
        inner = InMemoryProvider(create_delay_s=0.2)
        provider = CountingProvider(inner)
        manager = SandboxManager(provider, max_concurrent_creates=1)  # type: ignore[arg-type]
        first = asyncio.get_running_loop().create_task(manager.create())
        await asyncio.sleep(0.05)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert provider.in_flight == 1  # the provider's create goes on
        second = await manager.create()
        assert provider.max_in_flight == 1, "the slot was freed while the first create still ran"
        await manager.drain()
        late = [sid for sid in inner.destroyed if sid != second.id]
        assert len(late) == 1, "the late sandbox was not destroyed"
        assert list(inner.live) == [second.id]
        await manager.aclose()
        assert inner.live == {}

    asyncio.run(main())


def test_keepalive_rearms_ttl_then_stops_on_destroy() -> None:
    async def main() -> None:
        provider = InMemoryProvider()
        async with SandboxManager(provider) as manager:
            kept = await manager.create(SandboxSpec(ttl_s=0.3))
            await asyncio.sleep(0.75)  # more than two TTLs: only the beats keep it alive
            assert kept.id in provider.live and provider.extends.count(kept.id) >= 3
            await kept.destroy()
            beats = provider.extends.count(kept.id)
            await asyncio.sleep(0.35)
            assert provider.extends.count(kept.id) == beats, "keepalive beat a destroyed sandbox"
            assert not manager.keepalive.running

    asyncio.run(main())


def test_without_beats_the_ttl_reclaims() -> None:
    async def main() -> None:
        provider = InMemoryProvider()
        async with SandboxManager(provider, keepalive=False) as manager:
            box = await manager.create(SandboxSpec(ttl_s=0.2))
            await asyncio.sleep(0.3)
            assert await provider.list({}) == []
            await box.destroy()  # idempotent on a reclaimed sandbox

    asyncio.run(main())


def test_keepalive_drops_a_sandbox_that_vanished() -> None:
    async def main() -> None:
        provider = InMemoryProvider()
        async with SandboxManager(provider) as manager:
            box = await manager.create(SandboxSpec(ttl_s=0.15))
            provider.live.pop(box.id)
            await asyncio.sleep(0.2)
            assert box.id not in manager.keepalive and not manager.keepalive.running

    asyncio.run(main())


def test_image_builds_are_single_flight_and_memoized() -> None:
    async def main() -> None:
        provider = InMemoryProvider()
        provider.build_delay_s = 0.05
        recipe = ImageSpec("base", (Run("make"),))
        async with SandboxManager(provider, retry=FAST) as manager:
            refs = await asyncio.gather(*(manager.prepare_image(recipe) for _ in range(10)))
            assert len(set(refs)) == 1 and provider.builds == [recipe.digest]
            await manager.prepare_image(recipe)
            assert provider.builds == [recipe.digest]
            other = ImageSpec("base", (Run("make all"),))
            await manager.prepare_image(other)
            assert provider.builds == [recipe.digest, other.digest]

    asyncio.run(main())


def test_failed_image_build_is_retried_on_the_next_call() -> None:
    async def main() -> None:
        provider = InMemoryProvider()
        outcomes = [ImageBuildError("step 0 exited 1"), None]
        original = provider.prepare_image

        async def flaky(spec: ImageSpec):  # type: ignore[no-untyped-def]
            failure = outcomes.pop(0)
            if failure is not None:
                raise failure
            return await original(spec)

        provider.prepare_image = flaky  # type: ignore[method-assign]
        recipe = ImageSpec("base", (Run("make"),))
        async with SandboxManager(provider, retry=FAST) as manager:
            with pytest.raises(ImageBuildError):
                await manager.prepare_image(recipe)
            assert (await manager.prepare_image(recipe)).digest == recipe.digest

    asyncio.run(main())


def _dead_pid() -> tuple[str, str]:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start_time(child.pid) or ""
    child.wait()
    return str(child.pid), start


def test_orphan_rules() -> None:
    me = Owner.current("run-me")
    host = socket.gethostname()
    dead_pid, dead_start = _dead_pid()

    def info(**labels: str) -> SandboxInfo:
        return SandboxInfo("x", {LABEL_MANAGED: "1", LABEL_HOST: host, **labels})

    alive = info(**{LABEL_OWNER: "run-me", LABEL_PID: str(me.pid), LABEL_PID_START: me.pid_start})
    dead = info(**{LABEL_OWNER: "run-dead", LABEL_PID: dead_pid, LABEL_PID_START: dead_start})
    recycled = info(**{LABEL_OWNER: "run-old", LABEL_PID: str(me.pid), LABEL_PID_START: "1"})
    remote = SandboxInfo(
        "y", {LABEL_MANAGED: "1", LABEL_HOST: "elsewhere", LABEL_PID: dead_pid, LABEL_OWNER: "r"}
    )
    expired = SandboxInfo("z", remote.labels, expires_at=1.0)
    unmanaged = SandboxInfo("u", {LABEL_HOST: host, LABEL_PID: dead_pid})
    assert orphan_reason(alive, owner=None, host=host, now=2.0) is None
    assert "is gone" in (orphan_reason(dead, owner=None, host=host, now=2.0) or "")
    assert "is gone" in (orphan_reason(recycled, owner=None, host=host, now=2.0) or "")
    assert orphan_reason(remote, owner=None, host=host, now=2.0) is None
    assert "TTL" in (orphan_reason(expired, owner=None, host=host, now=2.0) or "")
    assert orphan_reason(unmanaged, owner=None, host=host, now=2.0) is None
    assert orphan_reason(alive, owner="run-me", host=host, now=2.0) == "owned by run run-me"
    assert orphan_reason(dead, owner="run-me", host=host, now=2.0) is None


def test_sweep_destroys_orphans_only() -> None:
    async def main() -> None:
        provider = InMemoryProvider()
        dead_pid, dead_start = _dead_pid()
        live_owner = Owner.current("run-live")
        dead_owner = Owner("run-dead", socket.gethostname(), int(dead_pid), dead_start)
        kept = await SandboxManager(provider, owner=live_owner, keepalive=False).create()
        doomed = await SandboxManager(provider, owner=dead_owner, keepalive=False).create()
        dry = await sweep(provider, dry_run=True)
        assert [r["id"] for r in dry.destroyed] == [doomed.id] and doomed.id in provider.live
        report = await sweep(provider)
        assert [r["id"] for r in report.destroyed] == [doomed.id]
        assert [r["id"] for r in report.kept] == [kept.id] and list(provider.live) == [kept.id]
        named = await sweep(provider, owner="run-live")
        assert [r["id"] for r in named.destroyed] == [kept.id] and provider.live == {}

    asyncio.run(main())
