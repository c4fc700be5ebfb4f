"""Session v1: one linear trajectory.

The session keeps a single path of turns (its *head* and the head's ancestors). A request
attaches somewhere on that path; attaching before the head discards the turns after the attach
point (a retry), at most :attr:`LinearStore.max_rollback` generated turns deep, otherwise 400.
Discarded turns are gone from records and samples; the commit is what discards them, so a
request that is rejected or fails upstream leaves the path untouched. One generation may be in
flight per session (a second request gets 409), and a commit whose plan went stale is refused
with 409 rather than dropped.
"""

from __future__ import annotations

from typing import Any

from miles_core.session.base import PromptTokenizer
from miles_core.session.completion import Completion
from miles_core.session.errors import Conflict, InvalidRequest
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


class LinearStore:
    __slots__ = ("_head", "_revision", "_seq", "max_rollback", "max_turns")  # one per session

    def __init__(self, *, max_turns: int, max_rollback: int = 1) -> None:
        self.max_turns = max_turns
        self.max_rollback = max_rollback
        self._head: Turn | None = None
        self._seq = 0  # turns committed so far (discarded ones included): the next seq - 1
        self._revision = 0

    def plan(self, request: ChatRequest, tokenizer: PromptTokenizer) -> Plan:
        if self._head is None:  # a new session: its first turn is a root
            if self.max_turns < 1:
                raise Conflict(f"session reached max_turns={self.max_turns}")
            return plan_turn(request, None, tokenizer, revision=self._revision)
        path = self._head.chain()
        attach = deepest_match(
            request.keys, path[:1], lambda turn: path[turn.depth : turn.depth + 1]
        )
        kept = attach.depth if attach else 0
        discard = len(path) - kept
        if discard > self.max_rollback:
            raise InvalidRequest(
                f"rollback failed: the request matches the history only up to generated turn {kept}, "
                f"so it would discard {discard} generated turns, more than max_rollback={self.max_rollback} "
                f"(stored history has {self._head.path_messages if self._head else 0} messages, "
                f"the request has {len(request.keys)})"
            )
        if kept + 1 > self.max_turns:
            raise Conflict(f"session reached max_turns={self.max_turns}")
        return plan_turn(request, attach, tokenizer, revision=self._revision)

    def commit(self, plan: Plan, completion: Completion, record: Record) -> Turn:
        if plan.revision != self._revision:
            raise Conflict(
                "the session changed while this generation was in flight; v1 records one linear "
                "trajectory, so this generation was not recorded"
            )
        turn = build_turn(self._seq + 1, plan, completion, record)
        self._seq += 1
        self._revision += 1
        self._head = turn
        return turn

    def describe(self) -> dict[str, Any]:
        path = self._head.chain() if self._head else []
        return {
            "records": [turn.record_dict() for turn in path],
            "metadata": {
                "accumulated_token_ids": list(self._head.token_ids) if self._head else [],
                "num_records": len(path),
                "turns": [turn.summary() for turn in path],
            },
        }

    def samples(self, options: SampleOptions) -> SampleBatch:
        head = self._head
        return assemble_samples((head,) if head else (), options)
