"""The built-in orchestrators: ``inprocess`` and ``ray`` (descriptors; ray loads in ``build``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager
    from miles_core.rl.config import TrainConfig
    from miles_core.rl.runtime import Parts, Runtime

#: the oldest Ray the actor code is written against (pyproject's ray extra)
MIN_RAY = (2, 40)


@dataclass(frozen=True)
class InProcess:
    """Every part in this process: the engine on a background thread, the session server, trainer and rewards."""

    name: str = "inprocess"
    description: str = "engine (a background thread), session server, trainer and rewards in this process"
    settings: frozenset[str] = frozenset()

    def build(self, config: TrainConfig, pm: MilesPluginManager, parts: Parts) -> Runtime:
        from miles_core.rl.runtime import build_inprocess

        return build_inprocess(config, pm, parts)

    def verify(self) -> None:
        import miles_core.rl.runtime  # noqa: F401  (the in-process build imports)
        from miles_core.rl.registry import require_module

        for module in ("transformers", "safetensors"):  # what it loads the engine and trainer with
            require_module(module, "train")


@dataclass(frozen=True)
class Ray:
    """The engine, trainer and rollout workers as Ray actors in one placement group."""

    name: str = "ray"
    description: str = "engine, trainer and rollout workers as Ray actors in one placement group"
    settings: frozenset[str] = frozenset(
        {"address", "rollout_workers", "num_cpus_per_actor", "num_gpus_engine", "num_gpus_trainer"}
    )

    def build(self, config: TrainConfig, pm: MilesPluginManager, parts: Parts) -> Runtime:
        from miles_core.rl.orchestrators.ray import build_ray

        return build_ray(config, pm, parts)

    def verify(self) -> None:
        from importlib import metadata

        from miles_core.rl.registry import require_module

        require_module("ray", "ray")
        version = metadata.version("ray")
        parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
        if parts < MIN_RAY:
            raise RuntimeError(f"ray {version} is older than {'.'.join(map(str, MIN_RAY))}: pip install -U 'miles[ray]'")


BUILTIN_ORCHESTRATORS = (InProcess(), Ray())
