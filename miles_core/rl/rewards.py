"""Scoring completions: in-process callables, or checker programs in a warm sandbox.

A :class:`~miles_core.rl.tasks.SandboxReward` runs in the configured sandbox provider. One
sandbox is created when the run starts (the checker written into it once) and kept for the
whole run; each step sends its whole batch in one file and runs the checker once, so sandbox
start-up never sits on the step's critical path and there is one exec per step, not per sample.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.config import RewardSection
from miles_core.rl.tasks import RewardFn, RewardInput, SandboxReward

PROGRAM = "reward_check.py"
BATCH = "reward_batch.json"


class RewardRunner:
    """Scores batches; ``where`` names where the reward runs (it labels the time split)."""

    def __init__(self, reward: SandboxReward | RewardFn, settings: RewardSection, pm: Any, aio: BackgroundLoop) -> None:
        self.reward = reward
        self.settings = settings
        self.aio = aio
        self._manager: Any = None
        self._sandbox: Any = None
        if isinstance(reward, SandboxReward):
            self.where = f"sandbox_{settings.sandbox_provider}"
            self.aio.run(self._start(pm))
        else:
            self.where = "inprocess"

    async def _start(self, pm: Any) -> None:
        from miles_core.sandbox.base import SandboxSpec
        from miles_core.sandbox.lifecycle import SandboxManager

        contribution = pm.contribution("sandbox", self.settings.sandbox_provider)
        pm.verify(contribution, contribution.obj.verify)
        provider = contribution.obj.create()
        self._manager = SandboxManager(provider)
        self._sandbox = await self._manager.create(SandboxSpec(labels={"miles.role": "reward"}))
        assert isinstance(self.reward, SandboxReward)
        await self._sandbox.write_file(PROGRAM, self.reward.program)
        for name, content in self.reward.files.items():
            await self._sandbox.write_file(name, content)

    def score(self, inputs: Sequence[RewardInput]) -> list[float]:
        if not inputs:
            return []
        if isinstance(self.reward, SandboxReward):
            return self.aio.run(self._score_in_sandbox(list(inputs)))
        values = [float(v) for v in self.reward(list(inputs))]
        if len(values) != len(inputs):
            raise RuntimeError(f"reward returned {len(values)} values for {len(inputs)} inputs")
        return values

    async def _score_in_sandbox(self, inputs: list[RewardInput]) -> list[float]:
        assert isinstance(self.reward, SandboxReward)
        await self._sandbox.write_file(BATCH, json.dumps([i.to_json() for i in inputs]))
        started = time.perf_counter()
        result = await self._sandbox.exec(["python3", PROGRAM, BATCH], timeout=self.settings.timeout_s)
        if result.timed_out or result.exit_code != 0:
            raise RuntimeError(
                f"reward {self.reward.name!r} failed in sandbox {self.settings.sandbox_provider!r} "
                f"(exit {result.exit_code}, timed out {result.timed_out}, "
                f"{time.perf_counter() - started:.1f}s): {result.stderr[-500:]}"
            )
        return self.reward.decode(result.stdout, len(inputs))

    def close(self) -> None:
        if self._manager is not None:
            manager, self._manager = self._manager, None
            self.aio.run(self._close(manager))

    @staticmethod
    async def _close(manager: Any) -> None:
        await manager.aclose()
        await manager.provider.aclose()
