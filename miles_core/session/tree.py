"""Session v2: a trajectory tree.

Every generated turn is kept. A request attaches to the deepest turn whose path its messages
extend (any depth, any branch) and its turn becomes a new child there; a request that matches no
turn opens a new root. Concurrent requests from one turn become siblings, so nothing waits and
nothing is dropped.

Samples: one per kept leaf, in commit order. A leaf that has a later sibling (same parent,
committed after it) was superseded by a retry and is not kept -- this applies to roots too, so a
retried first turn yields one sample, as in v1. A turn shared by several kept leaves is trained
only in the first sample that contains it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_core.session.base import PromptTokenizer
from miles_core.session.completion import Completion
from miles_core.session.errors import Conflict
from miles_core.session.normalize import ChatRequest
from miles_core.session.trajectory import (
    Plan,
    Record,
    SampleBatch,
    SampleOptions,
    Turn,
    assemble_samples,
    build_turn,
    deepest_match,
    plan_turn,
)


class TreeStore:
    def __init__(self, *, max_turns: int) -> None:
        self.max_turns = max_turns
        self._turns: list[Turn] = []  # in commit order: seq == index + 1
        self._roots: list[Turn] = []
        self._children: dict[int, list[Turn]] = {}

    def plan(self, request: ChatRequest, tokenizer: PromptTokenizer) -> Plan:
        self._check_capacity()
        attach = deepest_match(request.keys, self._roots, lambda turn: self._children.get(turn.seq, ()))
        return plan_turn(request, attach, tokenizer, revision=len(self._turns))

    def commit(self, plan: Plan, completion: Completion, record: Record) -> Turn:
        self._check_capacity()  # concurrent plans may all have passed the check in plan()
        turn = build_turn(len(self._turns) + 1, plan, completion, record)
        self._turns.append(turn)
        if turn.parent is None:
            self._roots.append(turn)
        else:
            self._children.setdefault(turn.parent.seq, []).append(turn)
        return turn

    def describe(self) -> dict[str, Any]:
        turns = tuple(self._turns)
        return {
            "records": [turn.record_dict() for turn in turns],
            "metadata": {
                "accumulated_token_ids": list(turns[-1].token_ids) if turns else [],
                "num_records": len(turns),
                "turns": [turn.summary() for turn in turns],
                "sample_leaves": [turn.seq for turn in kept_leaves(turns)],
            },
        }

    def samples(self, options: SampleOptions) -> SampleBatch:
        return assemble_samples(kept_leaves(tuple(self._turns)), options)

    def _check_capacity(self) -> None:
        if len(self._turns) >= self.max_turns:
            raise Conflict(f"session reached max_turns={self.max_turns}")


def kept_leaves(turns: Sequence[Turn]) -> list[Turn]:
    """Leaves not superseded by a later sibling, in commit order (``turns`` is in commit order)."""
    parents = {turn.parent.seq for turn in turns if turn.parent is not None}
    latest_child: dict[int, int] = {}  # parent seq (0 for roots) -> latest child seq
    for turn in turns:
        latest_child[turn.parent.seq if turn.parent else 0] = turn.seq
    return [
        turn
        for turn in turns
        if turn.seq not in parents and latest_child[turn.parent.seq if turn.parent else 0] == turn.seq
    ]
