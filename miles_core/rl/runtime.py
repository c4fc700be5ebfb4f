"""A run's parts: the plugin objects it uses (:class:`Parts`, resolved and verified before anything
is built) and the built pieces the loop talks to (:class:`Runtime`), assembled in this process.

The Ray orchestrator builds the same :class:`Runtime` with the engine, trainer and rollout
replaced by actor proxies (:mod:`miles_core.rl.orchestrators.ray`); nothing in the loop knows the
difference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from miles_core.errors import ConfigError
from miles_core.plugins import MilesPluginManager
from miles_core.rl import registry
from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.algorithms.base import Algorithm
from miles_core.rl.config import TrainConfig
from miles_core.rl.rewards import RewardRunner
from miles_core.rl.rollout.base import (
    GenerationEngine,
    Rollout,
    RolloutContext,
    RolloutFunction,
    load_tokenizer,
)
from miles_core.rl.tasks import TrainableTask, resolve_reward, trainable
from miles_core.rl.trainers.base import Trainer, TrainerBackend

if TYPE_CHECKING:
    import torch

    from miles_core.engine.engine import EngineConfig
    from miles_core.rl.rollout.direct import DirectRollout


@dataclass(frozen=True)
class Parts:
    """The plugin objects a run uses, each resolved by name and verified."""

    task: TrainableTask
    algorithm: Algorithm
    rollout: RolloutFunction
    trainer: TrainerBackend


def resolve_task(config: TrainConfig, pm: MilesPluginManager) -> TrainableTask:
    """The configured task, verified, with its defaults (or a ConfigError naming what it lacks)."""
    contribution = registry.resolve(pm, "tasks", config.task.name, "task.name", "task")
    reward = resolve_reward(config.task.reward) if config.task.reward else None
    return trainable(contribution.obj, reward)


def resolve_parts(config: TrainConfig, pm: MilesPluginManager) -> Parts:
    return Parts(
        task=resolve_task(config, pm),
        algorithm=registry.algorithm(pm, config),
        rollout=registry.rollout_function(pm, config),
        trainer=registry.trainer_backend(pm, config),
    )


def model_directory(config: TrainConfig) -> Path:
    if config.model.path is not None:
        path = Path(config.model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
        return path
    from miles_core.engine.presets import preset_dir

    assert config.model.preset is not None  # ModelSection validates exactly one of path and preset
    return preset_dir(config.model.preset)


def resolve_device(setting: str) -> torch.device:
    """``auto``: the device of the selected hardware backend (activated and verified)."""
    from miles_core.hardware.devices import resolve_device as hardware_device

    return hardware_device(setting, "trainer.device")


#: the most sequences the engine decodes at once: a step's whole rollout up to here (the small-gpu
#: preset's 880) runs as one batch instead of waves; each slot's recurrent and conv state is
#: preallocated, so the engine's memory grows with this
MAX_ENGINE_BATCH = 1024


def engine_config(config: TrainConfig, num_prompts: int, device: str) -> EngineConfig:
    """The embedded engine's settings for a run, in this process or in a Ray actor: room for a
    step's samples (or every prompt, for evaluation) in one batch."""
    from miles_core.engine.engine import EngineConfig

    per_step = config.rollout.prompts_per_step * config.rollout.samples_per_prompt
    return EngineConfig(
        max_batch_size=max(1, min(MAX_ENGINE_BATCH, max(per_step, num_prompts))), dtype=config.model.dtype,
        device=device, seed=config.run.seed, cpu_threads=config.run.torch_threads,
        gdn_state_dtype=config.rollout.gdn_state_dtype,
    )


@dataclass
class Runtime:
    """The built parts of a run; ``close()`` releases them in reverse order of creation."""

    config: TrainConfig
    parts: Parts
    engine: GenerationEngine
    trainer: Trainer
    rollout: Rollout
    evaluator: DirectRollout  # greedy evaluation: every prompt, temperature 0, through the engine
    rewards: RewardRunner
    aio: BackgroundLoop
    closers: list[Callable[[], None]] = field(default_factory=list)

    def sync_weights(self, version: str) -> str:
        """Copy the trainer's weights into the engine as ``version``; returns the engine's version."""
        return self.engine.update_weights(self.trainer.engine_weights(), version)

    def close(self) -> None:
        errors = []
        for close in reversed(self.closers):
            try:
                close()
            except Exception as exc:  # keep closing the rest, then report every failure
                errors.append(exc)
        if errors:
            raise errors[0]


def freeze_startup_heap() -> None:
    """Move everything built so far (torch, transformers, the models: ~500k objects) out of the
    cyclic garbage collector's reach. Otherwise every full collection rescans all of it while
    holding the GIL -- a 260-315 ms stall of the rollout roughly every third step on the tiny
    preset. These objects live for the whole run anyway."""
    import gc

    gc.collect()
    gc.freeze()


def build_inprocess(config: TrainConfig, pm: MilesPluginManager, parts: Parts) -> Runtime:
    """Trainer first (it refuses unsafe models before anything else starts), then the engine."""
    import torch

    from miles_core.engine.engine import Engine
    from miles_core.rl.rollout.direct import DirectRollout

    torch.set_num_threads(config.run.torch_threads)
    torch.manual_seed(config.run.seed)
    model_dir = model_directory(config)
    device = resolve_device(config.trainer.device)
    trainer = parts.trainer.create(model_dir, config, device, parts.algorithm)
    tokenizer = load_tokenizer(model_dir)
    aio = BackgroundLoop()
    closers: list[Callable[[], None]] = [trainer.close, aio.close]
    try:
        # the reward sandbox starts on the background loop while the engine loads
        rewards = RewardRunner(parts.task.reward, config.reward, pm, aio)
        closers.append(rewards.close)
        engine = Engine.from_pretrained(model_dir, engine_config(config, len(parts.task.prompts), str(device)))
        closers.append(engine.close)
        rollout = parts.rollout.start(RolloutContext(config, parts.task, engine, tokenizer, model_dir, aio, pm))
        closers.append(rollout.close)
        rewards.ready()
    except BaseException:
        for close in reversed(closers):
            close()
        raise
    evaluator = DirectRollout(engine, tokenizer, config.rollout, config.run.seed)
    freeze_startup_heap()
    return Runtime(config, parts, engine, trainer, rollout, evaluator, rewards, aio, closers)
