"""The session-version protocol (what ``miles_session_versions`` returns) and the store protocol.

A **session version** is a small descriptor, cheap to import and construct:

* ``name`` -- what ``miles session serve --version`` selects;
* ``description`` -- one line for ``miles session versions``;
* ``max_in_flight`` -- generations one session may have in flight at once (``None``: no limit).
  The server answers a request beyond it with 409 instead of dropping a generation;
* ``create_store(max_turns=...)`` -- a fresh :class:`TrajectoryStore` for one session;
* ``verify()`` -- runs the session conformance suite (:mod:`miles_core.testing.session`) on a
  fresh store and raises if any invariant fails.

A **trajectory store** holds one session's turns. The server drives it in two steps around the
upstream call, so that a rejected or failed request changes nothing:

1. ``plan(request, tokenizer) -> Plan`` -- pure: decides where the request attaches, checks the
   version's policy (rollback depth, truncated parents, capacity) and computes the prompt ids.
   Raises a :class:`~miles_core.session.errors.SessionError` to reject.
2. ``commit(plan, completion, record) -> Turn`` -- the only mutation; records the generated turn
   or raises (409 when the plan went stale), never drops it silently.

``describe()`` returns the JSON-able ``{"records": [...], "metadata": {...}}`` of
``GET /sessions/{id}`` (``metadata.accumulated_token_ids`` included) and ``samples(options)`` the
training samples. ``samples`` may run in a worker thread while the event loop commits: read the
store's state once, atomically, before assembling.

Third parties add a version by returning their own descriptor from the hook; the stores in
:mod:`miles_core.session.linear` and :mod:`miles_core.session.tree` and the shared pieces in
:mod:`miles_core.session.trajectory` are there to build on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from miles_core.session.completion import Completion
    from miles_core.session.families import TemplateFamily
    from miles_core.session.normalize import ChatRequest
    from miles_core.session.tokenizer import Appended
    from miles_core.session.trajectory import Plan, Record, SampleBatch, SampleOptions, Turn


class PromptTokenizer(Protocol):
    """What a store needs to turn messages into prompt ids (:class:`~.tokenizer.ChatTokenizer`)."""

    family: TemplateFamily
    #: ids ``0 .. vocab_size - 1`` exist (added tokens included); the engine's ids are checked against it
    vocab_size: int

    def render_prompt(
        self, messages: Sequence[dict[str, Any]], *, tools: list[dict[str, Any]] | None, template_kwargs: Mapping[str, Any]
    ) -> tuple[int, ...]: ...

    def render_append(
        self,
        completion_ids: Sequence[int],
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
    ) -> Appended: ...


class TrajectoryStore(Protocol):
    def plan(self, request: ChatRequest, tokenizer: PromptTokenizer) -> Plan: ...

    def commit(self, plan: Plan, completion: Completion, record: Record) -> Turn: ...

    def describe(self) -> dict[str, Any]: ...

    def samples(self, options: SampleOptions) -> SampleBatch: ...


@runtime_checkable
class SessionVersion(Protocol):
    name: str
    description: str
    max_in_flight: int | None

    def create_store(self, *, max_turns: int) -> TrajectoryStore: ...

    def verify(self) -> None: ...
