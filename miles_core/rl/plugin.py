"""Built-in plugin ``core-rl``: the RL step's algorithms, rollout functions, trainer backends,
orchestrators and trackers, registered like any third-party plugin's.

Importing it imports descriptors only (no torch, no tracker SDK): discovery stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_core.hookspecs import hookimpl
from miles_core.rl.algorithms.builtin import BUILTIN_ALGORITHMS
from miles_core.rl.orchestrators.builtin import BUILTIN_ORCHESTRATORS
from miles_core.rl.rollout.builtin import BUILTIN_ROLLOUTS
from miles_core.rl.trackers.builtin import BUILTIN_TRACKERS
from miles_core.rl.trainers.builtin import BUILTIN_TRAINERS

if TYPE_CHECKING:  # the protocol modules: their data types are not needed to list descriptors
    from miles_core.rl.algorithms.base import Algorithm
    from miles_core.rl.orchestrators.base import Orchestrator
    from miles_core.rl.rollout.base import RolloutFunction
    from miles_core.rl.trackers.base import Tracker
    from miles_core.rl.trainers.base import TrainerBackend


@hookimpl
def miles_algorithms() -> list[Algorithm]:
    return list(BUILTIN_ALGORITHMS)


@hookimpl
def miles_rollout_functions() -> list[RolloutFunction]:
    return list(BUILTIN_ROLLOUTS)


@hookimpl
def miles_trainer_backends() -> list[TrainerBackend]:
    return list(BUILTIN_TRAINERS)


@hookimpl
def miles_orchestrators() -> list[Orchestrator]:
    return list(BUILTIN_ORCHESTRATORS)


@hookimpl
def miles_trackers() -> list[Tracker]:
    return list(BUILTIN_TRACKERS)
