"""The built-in session versions: descriptors only (stores are imported when a session starts)."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_core.session.base import TrajectoryStore


@functools.cache
def _store_class(module: str, name: str) -> Any:
    """A store class, imported when the first session starts (a session opens per episode)."""
    return getattr(importlib.import_module(module), name)


class ConformanceVerified:
    """Mixin: ``verify()`` runs the session conformance suite on the version's stores."""

    def verify(self) -> list[str]:
        from miles_core.testing.session import run_conformance

        return run_conformance(self)  # type: ignore[arg-type]  # mixed into SessionVersion classes only


@dataclass(frozen=True)
class LinearVersion(ConformanceVerified):
    """v1: one linear trajectory per session (:mod:`miles_core.session.linear`)."""

    name: str = "v1"
    description: str = "linear trajectory; a retry rolls back at most one generated turn; one generation in flight"
    max_in_flight: int | None = 1
    max_rollback: int = 1

    def create_store(self, *, max_turns: int) -> TrajectoryStore:
        store: TrajectoryStore = _store_class("miles_core.session.linear", "LinearStore")(
            max_turns=max_turns, max_rollback=self.max_rollback
        )
        return store


@dataclass(frozen=True)
class TreeVersion(ConformanceVerified):
    """v2: a trajectory tree per session (:mod:`miles_core.session.tree`)."""

    name: str = "v2"
    description: str = "trajectory tree; branches at any turn, one sample per kept leaf, superseded retries dropped"
    max_in_flight: int | None = None

    def create_store(self, *, max_turns: int) -> TrajectoryStore:
        store: TrajectoryStore = _store_class("miles_core.session.tree", "TreeStore")(max_turns=max_turns)
        return store
