"""Orchestrators: where a run's engine, trainer and rollout workers live, and what a
``miles_orchestrators`` contribution declares.

``build(config, pm, parts)`` places the run's parts (:class:`~miles_core.rl.runtime.Parts`: the task,
algorithm, rollout function and trainer backend, already resolved and verified by the loop) and
returns its :class:`~miles_core.rl.runtime.Runtime`, the object the loop talks to; the loop never
learns where the parts are. A worker in another process resolves the parts it needs by name from
its own plugins (the fingerprint check proves they are the same). Every process an orchestrator starts
checks the driver's plugin fingerprint before it builds anything
(:func:`miles_core.rl.orchestrators.fingerprint.check_fingerprint`).

Nothing here imports torch or ray (plugin discovery imports this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager
    from miles_core.rl.config import TrainConfig
    from miles_core.rl.runtime import Parts, Runtime


@runtime_checkable
class Orchestrator(Protocol):
    """An orchestrator contributed through ``miles_orchestrators``."""

    #: unique name; ``orchestrator.kind`` selects it
    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    #: ``orchestrator.*`` settings it reads besides ``kind``
    @property
    def settings(self) -> frozenset[str]: ...

    def build(self, config: TrainConfig, pm: MilesPluginManager, parts: Parts) -> Runtime:
        """Start the run's parts and return the runtime the loop drives."""
        ...

    def verify(self) -> None:
        """Raise unless the orchestrator can run here (its framework imports at a supported version)."""
        ...
