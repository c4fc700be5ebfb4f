"""Scoring completions: in-process callables, or checker programs in a warm sandbox.

A :class:`~miles_core.rl.tasks.SandboxReward` runs in the configured sandbox provider. One
sandbox is created when the run starts (the checker written into it once) and kept for the
whole run; each step sends its whole batch in one file and runs the checker once, so sandbox
start-up never sits on the step's critical path and there is one exec per step, not per sample.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.config import RewardSection
from miles_core.rl.sandboxes import WarmSandbox
from miles_core.rl.tasks import RewardFn, RewardInput, SandboxReward

PROGRAM = "reward_check.py"

log = logging.getLogger(__name__)


class RewardRunner:
    """Scores batches; ``where`` names where the reward runs (it labels the time split).

    A sandbox reward's sandbox is created and its checker installed on the background loop while
    the caller goes on building (the engine loads meanwhile); :meth:`ready` waits for it and
    raises what went wrong, and the first :meth:`score` waits too.
    """

    def __init__(self, reward: SandboxReward | RewardFn, settings: RewardSection, pm: Any, aio: BackgroundLoop) -> None:
        self.reward = reward
        self.aio = aio
        self._sandbox: WarmSandbox | None = None
        self._pending: concurrent.futures.Future[WarmSandbox] | None = None
        if isinstance(reward, SandboxReward):
            self.where = f"sandbox_{settings.sandbox_provider}"
            self._pending = aio.submit(self._open(reward, settings, pm))
        else:
            self.where = "inprocess"

    async def _open(self, reward: SandboxReward, settings: RewardSection, pm: Any) -> WarmSandbox:
        sandbox = await WarmSandbox(
            pm, settings.sandbox_provider, "reward", self.aio, settings.timeout_s, settings.sandbox_options
        ).start()
        try:
            await sandbox.install(PROGRAM, reward.program)
            for name, content in reward.files.items():
                await sandbox.install(name, content)
        except BaseException:
            await sandbox.aclose()
            raise
        return sandbox

    def ready(self) -> None:
        """Wait until the reward sandbox is up with its checker installed (raises its failure)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._sandbox = pending.result()

    def score(self, inputs: Sequence[RewardInput]) -> list[float]:
        if not inputs:
            return []
        if isinstance(self.reward, SandboxReward):
            self.ready()
            assert self._sandbox is not None
            payload = [i.to_json() for i in inputs]
            stdout = self.aio.run(self._sandbox.call(PROGRAM, payload, f"reward {self.reward.name!r}"))
            return self.reward.decode(stdout, len(inputs))
        values = [float(v) for v in self.reward(list(inputs))]
        if len(values) != len(inputs):
            raise RuntimeError(f"reward returned {len(values)} values for {len(inputs)} inputs")
        return values

    def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            error = pending.exception()  # waits; a failed start has already removed its sandbox
            if error is None:
                self._sandbox = pending.result()
            else:
                log.warning("the reward sandbox failed to start while the run was being torn down: %s", error)
        if self._sandbox is not None:
            self._sandbox.close()
