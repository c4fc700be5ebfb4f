"""Scoring completions: in-process callables, or checker programs in a warm sandbox.

A :class:`~miles_core.rl.tasks.SandboxReward` runs in the configured sandbox provider. One
sandbox is created when the run starts (the checker written into it once) and kept for the
whole run; each step sends its whole batch in one file and runs the checker once, so sandbox
start-up never sits on the step's critical path and there is one exec per step, not per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.config import RewardSection
from miles_core.rl.sandboxes import WarmSandbox
from miles_core.rl.tasks import RewardFn, RewardInput, SandboxReward

PROGRAM = "reward_check.py"


class RewardRunner:
    """Scores batches; ``where`` names where the reward runs (it labels the time split)."""

    def __init__(self, reward: SandboxReward | RewardFn, settings: RewardSection, pm: Any, aio: BackgroundLoop) -> None:
        self.reward = reward
        self.aio = aio
        self._sandbox: WarmSandbox | None = None
        if isinstance(reward, SandboxReward):
            self.where = f"sandbox_{settings.sandbox_provider}"
            self._sandbox = WarmSandbox(
                pm, settings.sandbox_provider, "reward", aio, settings.timeout_s, settings.sandbox_options
            )
            aio.run(self._install(reward))
        else:
            self.where = "inprocess"

    async def _install(self, reward: SandboxReward) -> None:
        assert self._sandbox is not None
        await self._sandbox.install(PROGRAM, reward.program)
        for name, content in reward.files.items():
            await self._sandbox.install(name, content)

    def score(self, inputs: Sequence[RewardInput]) -> list[float]:
        if not inputs:
            return []
        if isinstance(self.reward, SandboxReward):
            assert self._sandbox is not None
            payload = [i.to_json() for i in inputs]
            stdout = self.aio.run(self._sandbox.call(PROGRAM, payload, f"reward {self.reward.name!r}"))
            return self.reward.decode(stdout, len(inputs))
        values = [float(v) for v in self.reward(list(inputs))]
        if len(values) != len(inputs):
            raise RuntimeError(f"reward returned {len(values)} values for {len(inputs)} inputs")
        return values

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
