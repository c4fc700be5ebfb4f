"""What the loop needs from a trainer backend, and how backends are looked up."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from miles_core.errors import ConfigError
from miles_core.rl.algorithms import TrainDocument

#: trainer.backend -> "module:class"; the class takes (model_dir, config, device)
BACKENDS: dict[str, str] = {
    "hf": "miles_core.rl.trainers.hf:HFTrainer",
    "megatron": "miles_core.rl.trainers.megatron:MegatronTrainer",
}


class Trainer(Protocol):
    """A policy being trained. Every method is called from one thread (or one Ray actor)."""

    #: what the model patches and the packing guard established, for the run summary
    report: Mapping[str, Any]

    def train(self, docs: Sequence[TrainDocument]) -> dict[str, float]:
        """One policy update on these documents; returns the step's training statistics."""

    def engine_weights(self) -> dict[str, Any]:
        """The current weights, named as the engine's (Hugging Face) model names them."""

    def save(self, directory: Path) -> None:
        """Weights (safetensors, Hugging Face layout, under ``directory/model``) and optimizer."""

    def load(self, directory: Path) -> None:
        """Restore what :meth:`save` wrote."""


def trainer_class(backend: str) -> type:
    from miles_core.plugins import import_object

    if backend not in BACKENDS:
        raise ConfigError(f"trainer.backend: unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    return import_object(BACKENDS[backend])
