"""The built-in rollout functions: ``direct`` and ``agentic`` (descriptors; implementations load in
``start``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_core.rl.rollout.base import Rollout, RolloutContext


def check_declarations(name: str, provides: frozenset[str], settings: frozenset[str]) -> None:
    """What every rollout function's ``verify()`` checks: known fields and settings."""
    from miles_core.rl.algorithms.base import ROLLOUT_FIELDS
    from miles_core.rl.config import RolloutSection

    unknown = sorted(provides - ROLLOUT_FIELDS.keys())
    if unknown:
        raise ValueError(f"rollout {name!r} provides unknown field(s) {unknown}; known: {sorted(ROLLOUT_FIELDS)}")
    missing = sorted({"token_ids", "loss_mask"} - provides)
    if missing:
        raise ValueError(f"rollout {name!r} must provide {missing}: training needs them")
    bad = sorted(settings - RolloutSection.model_fields.keys())
    if bad:
        raise ValueError(f"rollout {name!r} reads settings rollout.{bad} that do not exist")


@dataclass(frozen=True)
class DirectRolloutFunction:
    """Single-turn, token-in: prompts tokenized once and generated in one engine batch."""

    name: str = "direct"
    description: str = "prompts tokenized once and generated in one batch by the engine (token-in, single turn)"
    provides: frozenset[str] = frozenset({"token_ids", "loss_mask", "rollout_logprobs"})
    settings: frozenset[str] = frozenset()
    session_server: bool = False

    def start(self, context: RolloutContext) -> Rollout:
        from miles_core.rl.rollout.direct import DirectRollout

        return DirectRollout(context.engine, context.tokenizer, context.config.rollout, context.config.run.seed)

    def verify(self) -> None:
        """The declarations, and a tiny rollout against a scripted engine is token-exact."""
        from miles_core.rl.rollout.probe import run_tiny_rollout

        check_declarations(self.name, self.provides, self.settings)
        run_tiny_rollout(self)


@dataclass(frozen=True)
class AgenticRolloutFunction:
    """Multi-turn OpenAI-chat episodes through the session server; tools run in the sandbox."""

    name: str = "agentic"
    description: str = "OpenAI-chat episodes through the session server (multi-turn, tools run in the sandbox)"
    provides: frozenset[str] = frozenset({"token_ids", "loss_mask", "rollout_logprobs"})
    settings: frozenset[str] = frozenset({"session_version", "max_turns", "concurrency"})
    session_server: bool = True

    def start(self, context: RolloutContext) -> Rollout:
        from miles_core.rl.rollout.agentic import AgenticRollout

        return AgenticRollout.start(context)

    def verify(self) -> None:
        from miles_core.rl.registry import require_module
        from miles_core.rl.rollout.agentic import AgenticRollout

        check_declarations(self.name, self.provides, self.settings)
        if not callable(getattr(AgenticRollout, "run", None)):
            raise TypeError("AgenticRollout has no run()")
        for module in ("jinja2", "httptools"):  # the session service's chat templates, the HTTP client's pool
            require_module(module, "train")


BUILTIN_ROLLOUTS = (DirectRolloutFunction(), AgenticRolloutFunction())
