"""The built-in trainer backends: ``hf`` and ``megatron`` (descriptors; frameworks load in ``create``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from miles_core.rl.algorithms.base import Algorithm
    from miles_core.rl.config import TrainConfig
    from miles_core.rl.trainers.base import Trainer


@dataclass(frozen=True)
class HFBackend:
    """A transformers causal LM trained with torch (AdamW), FSDP2 across ranks."""

    name: str = "hf"
    description: str = "a transformers causal LM trained with torch (AdamW); FSDP2 over trainer.world_size ranks"
    settings: frozenset[str] = frozenset({"world_size", "compile", "gradient_checkpointing", "share_prompts"})

    def create(self, model_dir: Path, config: TrainConfig, device: torch.device, algorithm: Algorithm) -> Trainer:
        from miles_core.rl.trainers.hf import HFTrainer

        return HFTrainer(model_dir, config, device, algorithm)

    def verify(self) -> None:
        from miles_core.rl.trainers.probe import check_one_update

        check_one_update(self)


@dataclass(frozen=True)
class MegatronBackend:
    """megatron-core's GPTModel for Llama architectures, optionally with MTP layers."""

    name: str = "megatron"
    description: str = "megatron-core's GPTModel (Llama architectures), optionally with MTP layers"
    settings: frozenset[str] = frozenset({"mtp_num_layers", "mtp_loss_coef"})

    def create(self, model_dir: Path, config: TrainConfig, device: torch.device, algorithm: Algorithm) -> Trainer:
        from miles_core.rl.trainers.megatron import MegatronTrainer

        return MegatronTrainer(model_dir, config, device, algorithm)

    def verify(self) -> None:
        from miles_core.hardware import activate
        from miles_core.rl.registry import require_module

        require_module("megatron.core", "megatron")
        from miles_core.rl.trainers.probe import check_one_update

        activate()  # megatron runs through the selected hardware backend's fixes
        check_one_update(self)


BUILTIN_TRAINERS = (HFBackend(), MegatronBackend())
