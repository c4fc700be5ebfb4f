"""Conformance kit for sandbox providers, and the tools the lifecycle tests share.

Provider authors subclass :class:`ProviderConformance` in a test module and supply a
``provider_factory`` fixture returning a *new, unused* provider::

    from miles_core.testing.sandbox import ProviderConformance

    class TestMyProvider(ProviderConformance):
        base_image = "python:3.12-slim"

        @pytest.fixture
        def provider_factory(self):
            return lambda: MyProvider(...)

Each test runs in its own event loop (``drive``), labels what it creates with a fresh
``conformance.run`` label and fails if anything with that label is left behind. Limit tests run
``python3`` inside the sandbox and compare a violating command with a control that stays under
the limit, for every limit the provider declares in ``capabilities.limits``.

``test_hostile_probe`` runs every probe of :mod:`miles_core.testing.sandbox_probes` (what
model-written code tries: other processes' environments, signals, another sandbox's files,
escaping destroy, leftover files, a fork loop, the network, the host's processes and files) and
fails a probe the provider claims to stop (``capabilities.isolates``) that gets through;
unclaimed probes are reported as skipped, with what they found.

:func:`cancellation_storm` cancels many managed creates at random points and reports leaks and
the peak number of concurrent provider creates (via :class:`CountingProvider`).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import pytest

from miles_core.sandbox.base import (
    LABEL_OWNER,
    LIMIT_NAMES,
    Capabilities,
    Command,
    Copy,
    Endpoint,
    ExecResult,
    ImageRef,
    ImageSpec,
    Limits,
    Run,
    SandboxInfo,
    SandboxProvider,
    SandboxRef,
    SandboxSpec,
)
from miles_core.sandbox.errors import SandboxError, SandboxNotFound, SandboxUnsupported
from miles_core.sandbox.lifecycle import SandboxManager
from miles_core.sandbox.retry import RetryPolicy
from miles_core.testing.sandbox_probes import PROBES, ProbeResult, host_traps, hostile_probes, run_probe

__all__ = [
    "PROBES",
    "CountingProvider",
    "InMemoryProvider",
    "ProbeResult",
    "ProviderConformance",
    "StormReport",
    "cancellation_storm",
    "hostile_probes",
    "naive_create_leaks",
]

T = TypeVar("T")
RUN_LABEL = "conformance.run"
ProviderFactory = Callable[[], SandboxProvider]


def drive(factory: ProviderFactory, body: Callable[[SandboxProvider], Awaitable[T]]) -> T:
    """Run ``body(provider)`` in a fresh event loop with a fresh provider, then close it."""

    async def main() -> T:
        provider = factory()
        try:
            return await body(provider)
        finally:
            await provider.aclose()

    return asyncio.run(main())


# -- wrappers and doubles ---------------------------------------------------------------------


class CountingProvider:
    """Delegates to ``inner``; counts concurrent ``create`` calls (the concurrency limit), which
    ``label`` values are inside a create right now, and how long creates take."""

    def __init__(self, inner: SandboxProvider, label: str = "conformance.call") -> None:
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.label = label
        self.in_flight = 0
        self.max_in_flight = 0
        self.active: set[str] = set()
        self.durations: list[float] = []

    async def create(self, spec: SandboxSpec) -> SandboxRef:
        tag = spec.labels.get(self.label, "")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.active.add(tag)
        started = time.perf_counter()
        try:
            return await self.inner.create(spec)
        finally:
            self.durations.append(time.perf_counter() - started)
            self.active.discard(tag)
            self.in_flight -= 1

    def recent_create_s(self, window: int = 32) -> float:
        recent = self.durations[-window:]
        return sum(recent) / len(recent) if recent else 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class InMemoryProvider:
    """A provider double for lifecycle tests: sandboxes are dict entries, creates take
    ``create_delay_s`` (the sandbox appears half-way) and may be scripted to fail; TTLs expire
    on the event loop's clock. It runs no commands (``exec`` is unsupported)."""

    name = "memory"

    def __init__(self, *, create_delay_s: float = 0.0, failures: list[SandboxError] | None = None) -> None:
        self.capabilities = Capabilities(
            ttl="rearmable",
            network_isolation=True,
            expose=False,
            custom_base_images=True,
            background_exec=False,
            limits=frozenset(),
        )
        self.create_delay_s = create_delay_s
        self.failures = list(failures or [])
        self.live: dict[str, SandboxInfo] = {}
        self.deadlines: dict[str, float] = {}
        self.extends: list[str] = []
        self.destroyed: list[str] = []
        self.builds: list[str] = []
        self.build_delay_s = 0.0
        self.calls: list[str] = []

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _expire(self) -> None:
        now = self._now()
        for sandbox_id, deadline in list(self.deadlines.items()):
            if deadline <= now:
                self.live.pop(sandbox_id, None)
                self.deadlines.pop(sandbox_id, None)

    async def prepare_image(self, spec: ImageSpec) -> ImageRef:
        self.builds.append(spec.digest)
        await asyncio.sleep(self.build_delay_s)
        return ImageRef(self.name, spec.name, spec.digest)

    async def create(self, spec: SandboxSpec) -> SandboxRef:
        """Like a remote API: the sandbox exists half-way through the call, before the answer
        arrives -- a caller cancelled in the second half never learns its id."""
        self.calls.append("create")
        await asyncio.sleep(self.create_delay_s / 2)
        if self.failures:
            raise self.failures.pop(0)
        sandbox_id = uuid.uuid4().hex[:12]
        self.live[sandbox_id] = SandboxInfo(sandbox_id, dict(spec.labels))
        self.deadlines[sandbox_id] = self._now() + spec.ttl_s
        await asyncio.sleep(self.create_delay_s / 2)
        return SandboxRef(sandbox_id, self.name, dict(spec.labels))

    async def extend(self, sandbox_id: str, ttl_s: float) -> None:
        self._expire()
        self.extends.append(sandbox_id)
        if sandbox_id not in self.live:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", provider=self.name)
        self.deadlines[sandbox_id] = self._now() + ttl_s

    async def destroy(self, sandbox_id: str) -> bool:
        self._expire()
        self.destroyed.append(sandbox_id)
        self.deadlines.pop(sandbox_id, None)
        return self.live.pop(sandbox_id, None) is not None

    async def list(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        self._expire()
        return [i for i in self.live.values() if all(i.labels.get(k) == v for k, v in labels.items())]

    async def exec(self, ref: SandboxRef, cmd: Command, **kwargs: Any) -> ExecResult:
        raise SandboxUnsupported("the in-memory provider runs no commands", provider=self.name)

    async def write_file(self, ref: SandboxRef, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        raise SandboxUnsupported("the in-memory provider holds no files", provider=self.name)

    async def read_file(self, ref: SandboxRef, path: str) -> bytes:
        raise SandboxUnsupported("the in-memory provider holds no files", provider=self.name)

    async def expose(self, ref: SandboxRef, port: int) -> Endpoint:
        raise SandboxUnsupported("the in-memory provider has no ports", provider=self.name)

    async def aclose(self) -> None:
        return None


# -- cancellation storm -------------------------------------------------------------------------


@dataclass
class StormReport:
    creates: int
    completed_for_caller: int = 0
    cancelled_waiting: int = 0  # before the provider create started (or while backing off)
    cancelled_in_create: int = 0  # while the provider create was running: must be reaped
    max_in_flight: int = 0
    left_behind: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {k: (len(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}


async def cancellation_storm(
    provider: SandboxProvider,
    *,
    creates: int = 1000,
    limit: int = 8,
    seed: int = 0,
    spec: SandboxSpec | None = None,
    max_delay_s: float | None = None,
) -> StormReport:
    """Start ``creates`` managed creates, cancel each after a random delay, then count leftovers.

    Each delay is drawn from ``[0, max_delay_s]``; by default ``max_delay_s`` follows three
    times the recent provider create time, so cancellations land while waiting for a slot,
    inside the provider's create, and after it, whatever the provider's speed under load. At
    most ``2 * limit`` creates are outstanding at once. ``left_behind`` lists what the provider
    still reports for the storm's owner afterwards.
    """
    rng = random.Random(seed)
    counting = CountingProvider(provider, label="storm.call")
    manager = SandboxManager(
        counting,
        max_concurrent_creates=limit,
        retry=RetryPolicy(attempts=4, base_s=0.005, cap_s=0.05),
        rng=rng,
    )
    spec = spec or SandboxSpec(ttl_s=120)
    await (await manager.create(spec)).destroy()  # a first measurement of create time
    report = StormReport(creates=creates)
    gate = asyncio.Semaphore(2 * limit)
    wall = time.perf_counter()

    async def one(call: int) -> None:
        tag = str(call)
        async with gate:
            task = asyncio.get_running_loop().create_task(
                manager.create(replace(spec, labels={**spec.labels, "storm.call": tag}))
            )
            ceiling = max_delay_s if max_delay_s is not None else 3 * counting.recent_create_s()
            await asyncio.sleep(rng.uniform(0, ceiling))
            in_create = tag in counting.active
            task.cancel()
            try:
                sandbox = await task
            except asyncio.CancelledError:
                if in_create:
                    report.cancelled_in_create += 1
                else:
                    report.cancelled_waiting += 1
                return
            report.completed_for_caller += 1
            await manager.destroy(sandbox)

    await asyncio.gather(*(one(call) for call in range(creates)))
    await manager.aclose()
    report.max_in_flight = counting.max_in_flight
    report.left_behind = [i.id for i in await provider.list({LABEL_OWNER: manager.owner.run_id})]
    report.seconds = time.perf_counter() - wall
    return report


async def naive_create_leaks(
    provider: SandboxProvider, *, creates: int, max_delay_s: float, seed: int = 0
) -> int:
    """The negative control of the storm: cancel bare ``provider.create`` calls with
    ``wait_for`` (no lifecycle layer) and return how many sandboxes the provider still lists."""
    rng = random.Random(seed)
    for _ in range(creates):
        try:
            ref = await asyncio.wait_for(provider.create(SandboxSpec()), rng.uniform(0, max_delay_s))
        except TimeoutError:
            continue
        await provider.destroy(ref.id)
    return len(await provider.list({}))


# -- the conformance suite ----------------------------------------------------------------------

#: limit -> (spec limits that make the probe fail, violating command, control command)
LIMIT_PROBES: dict[str, tuple[dict[str, int], str, str]] = {
    "cpu_seconds": ({"cpu_seconds": 1}, "python3 -c 'while True: pass'", "python3 -c 'pass'"),
    "memory_mb": (
        {"memory_mb": 256},
        "python3 -c 'b = bytearray(512 * 2**20)'",
        "python3 -c 'b = bytearray(32 * 2**20)'",
    ),
    "file_size_mb": (
        {"file_size_mb": 1},
        "head -c 3145728 /dev/zero > big.bin",
        "head -c 524288 /dev/zero > small.bin",
    ),
    "open_files": (
        {"open_files": 32},
        "python3 -c 'fs = [open(\"/dev/null\") for _ in range(64)]'",
        "python3 -c 'fs = [open(\"/dev/null\") for _ in range(8)]'",
    ),
    "processes": (
        {"processes": 8},
        'python3 -c \'import subprocess; ps = [subprocess.Popen(["sleep", "5"]) for _ in range(24)]\'',
        'python3 -c \'import subprocess; ps = [subprocess.Popen(["sleep", "0"]) for _ in range(2)]; [p.wait() for p in ps]\'',
    ),
}


class ProviderConformance:
    """The provider contract as tests. Subclass and provide ``provider_factory``."""

    #: base image and build user for recipe tests (the provider's defaults)
    base_image: ClassVar[str] = "host"
    build_user: ClassVar[str] = "root"
    #: seconds for the TTL-expiry test; None skips it (providers whose minimum TTL is long)
    ttl_test_s: ClassVar[float | None] = 1.0
    #: the sandboxes run on this host (the hostile probes then also watch the host's processes
    #: and files after destroy)
    runs_on_this_host: ClassVar[bool] = True
    #: why the hostile probes cannot apply to this provider (an in-process fake, say); None: run
    hostile_probes_skip: ClassVar[str | None] = None

    @pytest.fixture
    def provider_factory(self) -> ProviderFactory:
        raise NotImplementedError("subclasses provide a provider_factory fixture")

    # helpers --------------------------------------------------------------------------------

    def check(
        self, factory: ProviderFactory, body: Callable[[SandboxProvider, dict[str, str]], Awaitable[T]]
    ) -> T:
        """Run ``body(provider, labels)``; fail if a sandbox with ``labels`` survives it."""
        labels = {RUN_LABEL: uuid.uuid4().hex}

        async def cleanup(provider: SandboxProvider) -> list[str]:
            leftovers = [info.id for info in await provider.list(labels)]
            for sandbox_id in leftovers:
                await provider.destroy(sandbox_id)
            return leftovers

        async def wrapped(provider: SandboxProvider) -> T:
            try:
                result = await body(provider, labels)
            except BaseException:
                await cleanup(provider)
                raise
            leftovers = await cleanup(provider)
            assert not leftovers, f"test left sandboxes behind: {leftovers}"
            return result

        return drive(factory, wrapped)

    # tests ----------------------------------------------------------------------------------

    def test_declares_capabilities(self, provider_factory: ProviderFactory) -> None:
        async def body(provider: SandboxProvider, labels: dict[str, str]) -> None:
            caps = provider.capabilities
            assert isinstance(caps, Capabilities)
            assert caps.ttl in ("rearmable", "hard")
            assert caps.limits <= set(LIMIT_NAMES), caps.limits
            assert isinstance(provider, SandboxProvider)

        self.check(provider_factory, body)

    def test_exec_round_trip(self, provider_factory: ProviderFactory) -> None:
        async def body(provider: SandboxProvider, labels: dict[str, str]) -> None:
            ref = await provider.create(SandboxSpec(labels=labels, env={"GREETING": "hello"}))
            try:
                shell = await provider.exec(ref, "echo $GREETING; echo oops >&2; exit 3")
                assert (shell.exit_code, shell.stdout, shell.stderr) == (3, "hello\n", "oops\n")
                assert not shell.ok and not shell.timed_out
                argv = await provider.exec(ref, ["printf", "%s|", "a b", "$HOME"])
                assert argv.ok and argv.stdout == "a b|$HOME|", argv
                override = await provider.exec(
                    ref, "echo $GREETING-$EXTRA", env={"GREETING": "hi", "EXTRA": "x"}
                )
                assert override.stdout == "hi-x\n"
                await provider.exec(ref, "mkdir -p sub/dir")
                where = await provider.exec(ref, "pwd", cwd="sub/dir")
                assert where.stdout.rstrip().endswith("/sub/dir"), where
            finally:
                assert await provider.destroy(ref.id) is True
            assert await provider.destroy(ref.id) is False
            with pytest.raises(SandboxError):
                await provider.exec(ref, "true")

        self.check(provider_factory, body)

    def test_files(self, provider_factory: ProviderFactory) -> None:
        async def body(provider: SandboxProvider, labels: dict[str, str]) -> None:
            ref = await provider.create(SandboxSpec(labels=labels))
            try:
                blob = bytes(range(256)) * 16
                await provider.write_file(ref, "data/blob.bin", blob)
                assert await provider.read_file(ref, "data/blob.bin") == blob
                await provider.write_file(ref, "data/note.txt", "text ✓\n")
                seen = await provider.exec(ref, "cat data/note.txt; wc -c < data/blob.bin")
                assert seen.stdout.split("\n")[:2] == ["text ✓", "4096"], seen
                await provider.exec(ref, "echo from-inside > made.txt")
                assert await provider.read_file(ref, "made.txt") == b"from-inside\n"
                with pytest.raises(SandboxError):
                    await provider.read_file(ref, "missing.txt")
            finally:
                await provider.destroy(ref.id)

        self.check(provider_factory, body)

    def test_timeout_kills_the_command(self, provider_factory: ProviderFactory) -> None:
        async def body(provider: SandboxProvider, labels: dict[str, str]) -> None:
            ref = await provider.create(SandboxSpec(labels=labels))
            try:
                started = time.monotonic()
                result = await provider.exec(ref, "sleep 30", timeout=0.5)
                assert result.timed_out and not result.ok, result
                assert time.monotonic() - started < 10
                assert (await provider.exec(ref, "echo alive")).stdout == "alive\n"
            finally:
                await provider.destroy(ref.id)

        self.check(provider_factory, body)

    def test_labels_list_and_extend(self, provider_factory: ProviderFactory) -> None:
        async def body(provider: SandboxProvider, labels: dict[str, str]) -> None:
            first = await provider.create(SandboxSpec(labels={**labels, "role": "a"}))
            second = await provider.create(SandboxSpec(labels={**labels, "role": "b"}))
            try:
                assert {i.id for i in await provider.list(labels)} == {first.id, second.id}
                only_b = await provider.list({**labels, "role": "b"})
                assert [i.id for i in only_b] == [second.id]
                assert only_b[0].labels["role"] == "b"
                await provider.extend(first.id, 120)
            finally:
                await provider.destroy(first.id)
                await provider.destroy(second.id)
            assert await provider.list(labels) == []
            with pytest.raises(SandboxNotFound):
                await provider.extend(first.id, 120)

        self.check(provider_factory, body)

    def test_ttl_reclaims(self, provider_factory: ProviderFactory) -> None:
        if self.ttl_test_s is None:
            pytest.skip("this provider's minimum TTL is too long for a unit test")
        ttl = self.ttl_test_s

        async def body(provider: SandboxProvider, labels: dict[str, str]) -> None:
            ref = await provider.create(SandboxSpec(labels=labels, ttl_s=ttl))
            if provider.capabilities.background_exec:  # a process must not keep it alive
                await provider.exec(ref, ["sleep", "600"], background=True)
            deadline = time.monotonic() + ttl + 10
            while await provider.list(labels):
                assert time.monotonic() < deadline, "the TTL did not reclaim the sandbox"
                await asyncio.sleep(0.1)
            with pytest.raises(SandboxError):
                await provider.exec(ref, "true")

        self.check(provider_factory, body)

    def test_image_recipe(self, provider_factory: ProviderFactory) -> None:
        recipe = ImageSpec(
            self.base_image,
            (Copy("assets/answer.txt", b"42\n"), Run("cat assets/answer.txt > baked.txt")),
            user=self.build_user,
        )

        async def body(provider: SandboxProvider, labels: dict[str, str]) -> None:
            ref = await provider.prepare_image(recipe)
            assert ref.digest == recipe.digest and ref.provider == provider.name
            assert await provider.prepare_image(recipe) == ref  # prepared images are reused
            box = await provider.create(SandboxSpec(image=ref, labels=labels))
            try:
                result = await provider.exec(box, "cat baked.txt assets/answer.txt")
                assert result.stdout == "42\n42\n", result
            finally:
                await provider.destroy(box.id)

        self.check(provider_factory, body)

    def test_expose(self, provider_factory: ProviderFactory) -> None:
        async def body(provider: SandboxProvider, labels: dict[str, str]) -> None:
            ref = await provider.create(SandboxSpec(labels=labels, network=True))
            try:
                if not provider.capabilities.expose:
                    with pytest.raises(SandboxUnsupported):
                        await provider.expose(ref, 8000)
                    return
                endpoint = await provider.expose(ref, 8000)
                assert endpoint.url.startswith(("http://", "https://")) and "8000" in endpoint.url
                with pytest.raises(SandboxError):
                    await provider.expose(ref, 70000)
            finally:
                await provider.destroy(ref.id)

        self.check(provider_factory, body)

    @pytest.mark.parametrize("limit", LIMIT_NAMES)
    def test_limit_enforced(self, provider_factory: ProviderFactory, limit: str) -> None:
        """Each declared limit: the violating command fails, the control under it succeeds."""
        overrides, violate, control = LIMIT_PROBES[limit]

        async def body(provider: SandboxProvider, labels: dict[str, str]) -> None:
            if limit not in provider.capabilities.limits:
                pytest.skip(f"{provider.name} does not declare the {limit} limit")
            spec = SandboxSpec(labels=labels, limits=replace(Limits(), **overrides))
            ref = await provider.create(spec)
            try:
                ok = await provider.exec(ref, control, timeout=60)
                assert ok.ok, f"control for {limit} failed: {ok}"
                bad = await provider.exec(ref, violate, timeout=60)
                assert not bad.ok and not bad.timed_out, f"{limit} was not enforced: {bad}"
            finally:
                await provider.destroy(ref.id)

        self.check(provider_factory, body)

    @pytest.mark.parametrize("probe", list(PROBES))
    def test_hostile_probe(self, provider_factory: ProviderFactory, probe: str) -> None:
        """A probe the provider claims to stop must not get through (see sandbox_probes)."""
        if self.hostile_probes_skip is not None:
            pytest.skip(self.hostile_probes_skip)

        async def body(provider: SandboxProvider, labels: dict[str, str]) -> ProbeResult:
            with host_traps() as traps:
                return await run_probe(provider, probe, traps, local=self.runs_on_this_host, labels=labels)

        result = self.check(provider_factory, body)
        if not result.observed:
            pytest.skip(f"{probe}: not observable here ({result.evidence})")
        if not result.claimed:
            pytest.skip(f"{probe} is not claimed by this provider (escaped={result.escaped}: {result.evidence})")
        assert not result.escaped, f"{probe} got through: {result.evidence}"

    def test_cancellation_storm_small(self, provider_factory: ProviderFactory) -> None:
        """A short storm (the full 1,000-create storm lives in each provider's own tests)."""

        async def body(provider: SandboxProvider, labels: dict[str, str]) -> StormReport:
            return await cancellation_storm(
                provider, creates=60, limit=4, seed=7, spec=SandboxSpec(labels=labels)
            )

        report = self.check(provider_factory, body)
        assert report.left_behind == [] and report.max_in_flight <= 4, report.to_dict()
