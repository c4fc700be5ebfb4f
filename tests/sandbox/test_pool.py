"""SandboxPool / SyncSandboxPool: warm sandboxes, fresh ones per use by default, recycling."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.sandbox.base import SandboxSpec
from miles_core.sandbox.errors import SandboxFatalError
from miles_core.sandbox.local.provider import LocalProvider
from miles_core.sandbox.pool import SandboxPool, SyncSandboxPool
from miles_core.testing.sandbox import InMemoryProvider

register_cpu_ci(est_time=4, suite="stage-a-cpu")

SOLUTION = "import sys\nprint(sum(map(int, sys.argv[1:])))\n"


def test_pool_runs_files_and_gives_every_call_a_fresh_sandbox(sandbox_root: Path) -> None:
    async def main() -> None:
        provider = LocalProvider(sandbox_root)
        async with SandboxPool(provider, SandboxSpec(ttl_s=60), size=3) as pool:
            results = await asyncio.gather(
                *(pool.exec(["python3", "sol.py", str(i), "1"], files={"sol.py": SOLUTION}) for i in range(8))
            )
            assert [r.stdout for r in results] == [f"{i + 1}\n" for i in range(8)]
            leak = await pool.exec("ls; echo secret > left.txt")
            assert "left.txt" not in leak.stdout
            again = await pool.exec("cat left.txt")
            assert again.exit_code != 0, "a file from an earlier call leaked into a fresh sandbox"
            slow = await pool.exec("sleep 5", timeout=0.2)
            assert slow.timed_out
            await asyncio.sleep(0.3)
            assert len(await provider.list({})) == 3  # refilled to size
        assert await provider.list({}) == []
        await provider.aclose()

    asyncio.run(main())


def test_pool_reuses_sandboxes_up_to_max_uses(sandbox_root: Path) -> None:
    async def main() -> None:
        provider = LocalProvider(sandbox_root)
        async with SandboxPool(provider, size=1, max_uses=3) as pool:
            ids = [(await pool.exec("echo $MILES_SANDBOX_ID")).stdout for _ in range(6)]
        assert len(set(ids)) == 2 and ids[0] == ids[1] == ids[2] != ids[3]
        await provider.aclose()

    asyncio.run(main())


def test_pool_reports_a_failing_create_and_keeps_trying() -> None:
    async def main() -> None:
        provider = InMemoryProvider(failures=[SandboxFatalError("quota exhausted")])
        pool = SandboxPool(provider, size=1)
        await pool.start()
        with pytest.raises(SandboxFatalError, match="quota exhausted"):
            await pool._acquire()
        box = await asyncio.wait_for(pool._acquire(), 5)  # the refill after the failure worked
        assert box.id in provider.live
        await pool._release(box, recycle=True)
        await pool.aclose()
        assert provider.live == {}

    asyncio.run(main())


def test_sync_pool_for_code_without_an_event_loop(sandbox_root: Path) -> None:
    with SyncSandboxPool("local", SandboxSpec(ttl_s=60), size=2, config={"root": str(sandbox_root)}) as pool:
        started = time.perf_counter()
        result = pool.exec(["python3", "sol.py", "40", "2"], files={"sol.py": SOLUTION}, timeout=30)
        assert result.ok and result.stdout == "42\n"
        assert time.perf_counter() - started < 30
    assert not any((sandbox_root / "sandboxes").iterdir())
