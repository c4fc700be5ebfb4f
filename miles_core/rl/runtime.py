"""Assemble a run's parts in this process: engine, trainer, rollout path, rewards.

:class:`Runtime` is what the loop talks to. The Ray orchestrator builds the same object with the
engine and trainer replaced by actor proxies (:mod:`miles_core.rl.orchestrators.ray`); nothing
in the loop knows the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError
from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.config import TrainConfig
from miles_core.rl.rewards import RewardRunner
from miles_core.rl.rollout.direct import DirectRollout
from miles_core.rl.tasks import Task, resolve_reward


def resolve_task(config: TrainConfig, pm: Any) -> Task:
    contribution = pm.contribution("tasks", config.task.name)
    pm.verify(contribution, contribution.obj.verify)
    return contribution.obj


def model_directory(config: TrainConfig) -> Path:
    if config.model.path is not None:
        path = Path(config.model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
        return path
    from miles_core.engine.presets import preset_dir

    return preset_dir(config.model.preset)


def resolve_device(setting: str) -> Any:
    """``auto``: the device of the selected hardware backend (activated and verified)."""
    import torch

    if setting != "auto":
        device = torch.device(setting)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"trainer.device: {setting!r} requested but CUDA is not available")
        return device
    from miles_core.hardware import activate

    return torch.device(activate().device)


def engine_batch_size(config: TrainConfig, num_prompts: int) -> int:
    per_step = config.rollout.prompts_per_step * config.rollout.samples_per_prompt
    return max(1, min(256, max(per_step, num_prompts)))


@dataclass
class Runtime:
    """The parts of a run; ``close()`` releases them in reverse order of creation."""

    config: TrainConfig
    task: Task
    tokenizer: Any
    engine: Any
    trainer: Any
    rollout: Any  # DirectRollout or AgenticRollout: run(prompts, step) -> trajectories
    evaluator: DirectRollout
    rewards: RewardRunner
    aio: BackgroundLoop
    rollout_via: str  # labels the rollout entry of the time split
    closers: list[Any] = field(default_factory=list)

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


def build_rollout(config: TrainConfig, task: Task, engine: Any, tokenizer: Any, model_dir: Path,
                  aio: BackgroundLoop, pm: Any, closers: list[Any]) -> tuple[Any, str]:
    if config.rollout.path == "direct":
        return DirectRollout(engine, tokenizer, config.rollout, config.run.seed), "direct"
    from miles_core.rl.rollout.agentic import AgenticRollout

    agentic = AgenticRollout.start(config, engine, tokenizer, aio, pm, model_dir, getattr(task, "tools", ()))
    closers.append(agentic.close)
    return agentic, f"session_{config.rollout.session_version}"


def freeze_startup_heap() -> None:
    """Move everything built so far (torch, transformers, the models: ~500k objects) out of the
    cyclic garbage collector's reach. Otherwise every full collection rescans all of it while
    holding the GIL -- a 260-315 ms stall of the rollout roughly every third step on the tiny
    preset. These objects live for the whole run anyway."""
    import gc

    gc.collect()
    gc.freeze()


def build_inprocess(config: TrainConfig, pm: Any) -> Runtime:
    """Trainer first (it refuses unsafe models before anything else starts), then the engine."""
    import torch
    from transformers import AutoTokenizer

    from miles_core.engine.engine import Engine, EngineConfig
    from miles_core.rl.trainers.base import trainer_class

    torch.set_num_threads(config.run.torch_threads)
    torch.manual_seed(config.run.seed)
    task = resolve_task(config, pm)
    reward = resolve_reward(config.task.reward) if config.task.reward else task.reward
    model_dir = model_directory(config)
    device = resolve_device(config.trainer.device)
    trainer = trainer_class(config.trainer.backend)(model_dir, config, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    aio = BackgroundLoop()
    closers: list[Any] = [getattr(trainer, "close", lambda: None), aio.close]
    engine = Engine.from_pretrained(
        model_dir,
        EngineConfig(
            max_batch_size=engine_batch_size(config, len(task.prompts())),
            dtype=config.model.dtype,
            device=str(device),
            seed=config.run.seed,
            cpu_threads=config.run.torch_threads,
        ),
    )
    closers.append(engine.close)
    try:
        rewards = RewardRunner(reward, config.reward, pm, aio)
        closers.append(rewards.close)
        rollout, via = build_rollout(config, task, engine, tokenizer, model_dir, aio, pm, closers)
    except BaseException:
        for close in reversed(closers):
            close()
        raise
    evaluator = DirectRollout(engine, tokenizer, config.rollout, config.run.seed)
    freeze_startup_heap()
    return Runtime(config, task, tokenizer, engine, trainer, rollout, evaluator, rewards, aio, via, closers)
