"""Rollout functions: how a run's trajectories are produced, and what a
``miles_rollout_functions`` contribution declares.

A rollout function is a descriptor; ``start(context)`` builds the run's :class:`Rollout` (the
heavy imports happen there). The loop calls ``rollout.run(prompts, step)`` once per step with the
step's prompts, each repeated ``rollout.samples_per_prompt`` times (contiguous groups), and needs
one :class:`~miles_core.rl.rollout.types.Trajectory` per prompt, in order, token-exact: the token
ids, loss mask and log-probs exactly as the engine sampled them, never re-tokenized.

Sample ``first_index + i`` of a step must be sampled with the seed
:func:`~miles_core.rl.rollout.types.sample_seed` ``(run seed, step, first_index + i)``: the Ray
orchestrator splits a step's batch over workers by ``first_index`` and expects the same tokens.

Nothing here imports torch (plugin discovery imports this module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

    from miles_core.engine.base import Completion, GenerationRequest
    from miles_core.plugins import MilesPluginManager
    from miles_core.rl.aio import BackgroundLoop
    from miles_core.rl.config import TrainConfig
    from miles_core.rl.rollout.types import Trajectory
    from miles_core.rl.tasks import Prompt, TrainableTask
    from miles_core.session.client import SessionClient


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the rollout paths use."""

    chat_template: str | None

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, list[int]]: ...

    def apply_chat_template(self, conversation: list[dict[str, object]], **kwargs: object) -> object: ...

    def decode(self, token_ids: Sequence[int], **kwargs: object) -> str: ...

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kwargs: object) -> list[str]: ...


def rollout_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A Hugging Face tokenizer as the rollout paths see it."""
    # transformers types decode() as str | list[str] for any input (a flat id list decodes to one str)
    return tokenizer  # type: ignore[return-value]


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The Hugging Face tokenizer of ``model_dir`` (imports transformers)."""
    from transformers import AutoTokenizer

    return rollout_tokenizer(AutoTokenizer.from_pretrained(model_dir))


class GenerationEngine(Protocol):
    """What the run needs from the inference engine: the embedded engine in-process, or an
    orchestrator's proxy of it (a Ray actor)."""

    @property
    def weight_version(self) -> str: ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]: ...

    def update_weights(self, weights: Any, version: str, /) -> str:
        """Load ``weights`` as ``version``. ``weights`` is what the run's trainer's
        ``engine_weights()`` returned (:data:`~miles_core.rl.trainers.base.EngineWeights`): each
        orchestrator pairs a trainer with an engine that takes its kind (a name -> tensor mapping
        in-process, a Ray object reference through a Ray engine actor)."""
        ...


class Rollout(Protocol):
    """A run's rollout, built by :meth:`RolloutFunction.start`."""

    #: names the rollout in the time split (``time_rollout_<label>``)
    label: str

    def run(self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0) -> list[Trajectory]:
        """One trajectory per prompt, in order (see the module doc for seeding)."""
        ...

    def close(self) -> None:
        """Stop what :meth:`RolloutFunction.start` started."""
        ...


@dataclass(frozen=True)
class RolloutContext:
    """What a rollout function gets to build a run's rollout."""

    config: TrainConfig
    task: TrainableTask
    engine: GenerationEngine
    tokenizer: Tokenizer
    model_dir: Path
    aio: BackgroundLoop  # the run's event loop, for async clients
    pm: MilesPluginManager
    #: a session server in front of the engine that the orchestrator already runs (a Ray engine
    #: actor's), for functions with ``session_server = True``; None: start one if needed
    session_url: str | None = None
    #: the same sessions through a client the orchestrator provides (a Ray engine actor's, over Ray
    #: calls): each batch call (``chat_many``...) reaches the engine as one batch, as in-process,
    #: where the HTTP server gets one request per session. The built-in agentic path prefers it.
    sessions: SessionClient | None = None


@runtime_checkable
class RolloutFunction(Protocol):
    """A rollout function contributed through ``miles_rollout_functions``."""

    #: unique name; ``rollout.path`` selects it
    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    #: keys of :data:`~miles_core.rl.algorithms.base.ROLLOUT_FIELDS` its trajectories carry
    @property
    def provides(self) -> frozenset[str]: ...
    #: ``rollout.*`` settings it reads besides the sampling ones every rollout honours
    @property
    def settings(self) -> frozenset[str]: ...
    #: whether it talks to the engine through the session server (an orchestrator that places the
    #: engine elsewhere starts one next to it and passes ``RolloutContext.session_url``)
    @property
    def session_server(self) -> bool: ...

    def start(self, context: RolloutContext) -> Rollout:
        """Build the run's rollout (start servers, open clients, install tools)."""
        ...

    def verify(self) -> None:
        """Raise unless the declarations are consistent and a tiny rollout is token-exact
        (:func:`miles_core.rl.rollout.probe.run_tiny_rollout`; a session-server function, which
        needs a real engine for that, checks what it can without one)."""
        ...
