"""A sandbox kept warm for a whole run, running small programs on JSON input.

Rewards and agent tools that execute model output share this pattern: the program is written
into the sandbox once; each call writes its input to a fresh file and runs ``python3 PROGRAM
INPUT``. Calls may overlap (each has its own input file). Lives on the run's event loop.

The provider is created with the options of ``[reward]`` (``sandbox_options``, or
``tool_sandbox_options`` for the agentic rollout's tools: :func:`tool_sandbox_settings`),
validated when the config was built.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles_core.rl.aio import BackgroundLoop

if TYPE_CHECKING:
    from miles_core.rl.config import RewardSection


class SandboxCallError(RuntimeError):
    pass


def tool_sandbox_settings(reward: RewardSection) -> tuple[str, dict[str, Any]]:
    """Provider and options of the agentic rollout's tool sandboxes: ``tool_sandbox_*`` where
    set, else the reward's (its options only when the provider is the same)."""
    provider = reward.tool_sandbox_provider or reward.sandbox_provider
    if reward.tool_sandbox_options is not None:
        return provider, dict(reward.tool_sandbox_options)
    return provider, dict(reward.sandbox_options) if provider == reward.sandbox_provider else {}


class WarmSandbox:
    """One sandbox of ``provider`` kept for a whole run; :meth:`start` creates it (on ``aio``'s loop)."""

    def __init__(
        self,
        pm: Any,
        provider: str,
        role: str,
        aio: BackgroundLoop,
        timeout_s: float,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.provider_name = provider
        self.aio = aio
        self.timeout_s = timeout_s
        self._pm, self._role, self._options = pm, role, dict(options or {})
        self._programs: set[str] = set()
        self._manager: Any = None
        self._sandbox: Any = None

    async def start(self) -> WarmSandbox:
        from miles_core.sandbox.base import SandboxSpec
        from miles_core.sandbox.lifecycle import SandboxManager

        contribution = self._pm.contribution("sandbox", self.provider_name)
        self._pm.verify(contribution, contribution.obj.verify)
        provider = contribution.obj.create(self._options)
        manager = SandboxManager(provider)
        try:
            self._sandbox = await manager.create(SandboxSpec(labels={"miles.role": self._role}))
        except BaseException:
            await _close(manager)
            raise
        self._manager = manager
        return self

    async def install(self, name: str, program: str) -> None:
        await self._sandbox.write_file(name, program)
        self._programs.add(name)

    async def call(self, program: str, payload: Any, what: str) -> str:
        """Run an installed program on ``payload`` (JSON); its stdout, or a named error."""
        if program not in self._programs:
            raise SandboxCallError(f"{what}: program {program!r} is not installed")
        path = f"input-{uuid.uuid4().hex}.json"
        await self._sandbox.write_file(path, json.dumps(payload))
        result = await self._sandbox.exec(["python3", program, path], timeout=self.timeout_s)
        if result.timed_out or result.exit_code != 0:
            raise SandboxCallError(
                f"{what} failed in sandbox provider {self.provider_name!r} (exit {result.exit_code}, "
                f"timed out {result.timed_out}): {result.stderr[-500:]}"
            )
        return result.stdout

    def close(self) -> None:
        self.aio.run(self.aclose())

    async def aclose(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            await _close(manager)


async def _close(manager: Any) -> None:
    await manager.aclose()
    await manager.provider.aclose()
