"""Where a run's parts live: in this process (default) or in Ray actors (``orchestrator.kind``)."""

from __future__ import annotations

from typing import Any

from miles_core.rl.config import TrainConfig


def run_training(config: TrainConfig, pm: Any, *, resume: bool = False) -> Any:
    from miles_core.rl.loop import train

    if config.orchestrator.kind == "ray":
        from miles_core.rl.orchestrators.ray import build_ray

        return train(config, pm, resume=resume, build=build_ray)
    return train(config, pm, resume=resume)
