"""Trainer backends: what the loop needs from a trainer, and what a ``miles_trainer_backends``
contribution declares.

Nothing here imports torch (plugin discovery imports this module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from miles_core.rl.algorithms.base import Algorithm
    from miles_core.rl.algorithms.batch import TrainDocument
    from miles_core.rl.config import TrainConfig

#: the trainer's weights on their way to the engine: a name -> tensor mapping in-process, or an
#: object the orchestrator's engine resolves (a Ray object reference)
EngineWeights = object


class Trainer(Protocol):
    """A policy being trained. Every method is called from one thread (or one Ray actor)."""

    #: what the model patches and the packing guard established, for the run summary
    @property
    def report(self) -> Mapping[str, object]: ...

    def train(self, docs: Sequence[TrainDocument]) -> dict[str, float]:
        """One policy update on these documents; returns the step's training statistics."""
        ...

    def engine_weights(self) -> EngineWeights:
        """The current weights, named as the engine's (Hugging Face) model names them."""
        ...

    def save(self, directory: Path) -> None:
        """Weights (safetensors, Hugging Face layout, under ``directory/model``) and optimizer."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what :meth:`save` wrote."""
        ...

    def close(self) -> None:
        """Release processes and memory the trainer holds."""
        ...


@runtime_checkable
class TrainerBackend(Protocol):
    """A trainer backend contributed through ``miles_trainer_backends``."""

    #: unique name; ``trainer.backend`` selects it
    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    #: ``trainer.*`` settings it reads besides backend, device, max_tokens_per_row and packing
    @property
    def settings(self) -> frozenset[str]: ...

    def create(self, model_dir: Path, config: TrainConfig, device: torch.device, algorithm: Algorithm) -> Trainer:
        """Build the trainer for ``model_dir`` (a Hugging Face directory); heavy imports here."""
        ...

    def verify(self) -> None:
        """Raise unless one update on a tiny model moves the weights as documented
        (:func:`miles_core.rl.trainers.probe.check_one_update`)."""
        ...
