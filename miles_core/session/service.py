"""The session service: the registry of sessions and the chat pipeline, independent of HTTP.

One chat turn::

    normalize (pure, 400)  ->  store.plan (pure: 400/409/422)  ->  upstream.generate (400/502)
        ->  store.commit (the only mutation)

The transports differ only at the two ends: the HTTP server (:mod:`.server`) hands in request
bytes (:meth:`SessionService.chat`) and an in-process caller a parsed body
(:meth:`SessionService.chat_object`); the upstream is an engine over HTTP or the embedded engine
in this process (:mod:`.upstream`). An in-process caller that drives many sessions in step (the
agentic rollout of ``miles train``: a GRPO batch) makes one call per phase instead of one per
session -- :meth:`~SessionService.create_many`, :meth:`~SessionService.chat_many`,
:meth:`~SessionService.samples_many`, :meth:`~SessionService.delete_many` -- each session's turn
going through the same pipeline, failing alone, and the turns reaching the upstream as one batch.

Everything before ``commit`` is free of side effects, so a request that is rejected or fails
upstream leaves the session byte-identical. Between the ``await`` on the engine and the commit
nothing else runs on the event loop, so stores need no locks; a version's ``max_in_flight``
bounds concurrent generations per session (409 beyond it, never a silent drop).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_core.frozen import quick_init
from miles_core.session.base import PromptTokenizer, SessionVersion, TrajectoryStore
from miles_core.session.completion import ChatTurn, Completion
from miles_core.session.config import ServiceLimits
from miles_core.session.errors import Conflict, InvalidRequest, SessionError, SessionNotFound
from miles_core.session.normalize import (
    ChatRequest,
    History,
    normalize_chat_batch,
    normalize_chat_object,
    normalize_chat_request,
    normalize_samples_request,
    parse_json_object,
)
from miles_core.session.trajectory import SampleBatch, SampleOptions
from miles_core.session.upstream import Generation, Upstream, UpstreamCall, upstream_error

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager
    from miles_core.session.families import TemplateFamily
    from miles_core.session.messages import Message, MessageKey
    from miles_core.session.tokenizer import Appended
    from miles_core.session.trajectory import Plan

__all__ = ["ChatOutcome", "Session", "SessionService", "activate_version", "upstream_error"]


def activate_version(name: str, pm: MilesPluginManager | None = None) -> SessionVersion:
    """The registered session version ``name``, verified (fails closed, naming the plugin).

    Here, not in :mod:`.server`: sessions served in this process (``LocalSessions``) activate
    a version too, and must not import the HTTP transport to do it."""
    from miles_core.plugins import get_plugin_manager

    pm = pm or get_plugin_manager()
    contribution = pm.contribution("session", name)
    pm.verify(contribution, contribution.obj.verify)
    return contribution.obj


@quick_init
@dataclass(frozen=True, eq=False)
class ChatOutcome:
    completion: Completion  # the generated turn as committed
    stream: bool
    include_usage: bool
    _reply: Callable[[], dict[str, Any]]

    @property
    def reply(self) -> dict[str, Any]:
        """What an HTTP agent receives (replay data stripped)."""
        return self._reply()


def new_session_ids(n: int) -> list[str]:
    """``n`` session ids: 128 random bits each, as 32 hex digits (one system call for all)."""
    digits = os.urandom(16 * n).hex()
    return [digits[i : i + 32] for i in range(0, 32 * n, 32)]


class Session:
    __slots__ = ("_history", "_idle", "_last_turn", "closing", "committed_tokens", "id", "in_flight", "store")

    def __init__(self, session_id: str, store: TrajectoryStore) -> None:
        self.id = session_id
        self.store = store
        self.in_flight = 0
        self.closing = False
        #: tokens in the snapshots of every committed turn: at least what assembling samples reads
        self.committed_tokens = 0
        self._last_turn: tuple[Any, ...] | None = None  # what :attr:`history` is built from
        self._history: History | None = None
        self._idle: asyncio.Event | None = None  # made when someone waits

    @property
    def history(self) -> History | None:
        """The conversation as of the last commit: what the next request is likely to repeat
        (built on first use: a session of one turn never needs it)."""
        if self._last_turn is not None:
            messages, keys, assistant, repeated = self._last_turn
            self._history, self._last_turn = History.after(messages, keys, assistant, repeated=repeated), None
        return self._history

    def committed(self, messages: tuple[Any, ...], keys: tuple[Any, ...], assistant: dict[str, Any], repeated: int) -> None:
        """Note the request (canonical ``messages`` and their ``keys``) a turn was committed for."""
        self._last_turn, self._history = (messages, keys, assistant, repeated), None

    def begin_generation(self, max_in_flight: int | None) -> None:
        """Take one generation slot for a chat turn (:meth:`end_generation` gives it back)."""
        if self.closing:
            raise Conflict(f"session {self.id} is being deleted")
        if max_in_flight is not None and self.in_flight >= max_in_flight:
            raise Conflict(
                f"session {self.id} already has {self.in_flight} generation(s) in flight and its version "
                f"allows {max_in_flight}; send the next request after the reply"
            )
        self.in_flight += 1

    def end_generation(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.in_flight:
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()


class SessionService:
    def __init__(
        self,
        version: SessionVersion,
        tokenizer: PromptTokenizer,
        upstream: Upstream,
        *,
        limits: ServiceLimits | None = None,
        session_ids: Callable[[int], list[str]] = new_session_ids,
    ) -> None:
        """``session_ids(n)``: ``n`` fresh ids (one worker of several creates only its own)."""
        self.version = version
        self.tokenizer = tokenizer
        self.upstream = upstream
        self.limits = limits or ServiceLimits()
        self._new_ids = session_ids
        self.instance_id = new_session_ids(1)[0]
        self._sessions: dict[str, Session] = {}

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "version": self.version.name,
            "instance_id": self.instance_id,
            "sessions": len(self._sessions),
        }

    def create(self, body: bytes = b"") -> str:
        if parse_json_object(body):
            raise InvalidRequest("POST /sessions takes no fields; send an empty body or {}")
        return self.create_many(1)[0]

    def create_many(self, n: int) -> list[str]:
        """``n`` new sessions, or none when they would not all fit (409)."""
        if len(self._sessions) + n > self.limits.max_sessions:
            raise Conflict(
                f"the server holds max_sessions={self.limits.max_sessions} sessions"
                + (f" and cannot open {n} more" if n > 1 else "")
                + "; delete finished ones"
            )
        create_store, max_turns, sessions = self.version.create_store, self.limits.max_turns, self._sessions
        ids = self._new_ids(n)
        for session_id in ids:
            sessions[session_id] = Session(session_id, create_store(max_turns=max_turns))
        return ids

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id[:64]!r}")
        return session

    def describe(self, session_id: str) -> dict[str, Any]:
        session = self.get(session_id)
        described = session.store.describe()
        metadata = {
            **described["metadata"],
            "version": self.version.name,
            "template_family": self.tokenizer.family.name,
            "in_flight": session.in_flight,
        }
        return {"session_id": session.id, "records": described["records"], "metadata": metadata}

    async def delete(self, session_id: str) -> None:
        """Refuse new turns, let in-flight ones finish and record, then forget the session."""
        await self.delete_many([session_id])

    async def delete_many(self, session_ids: Sequence[str], *, missing_ok: bool = False) -> None:
        """:meth:`delete` for each session; an unknown one raises 404 before any is touched
        (``missing_ok``: it is skipped, as a session already deleted)."""
        sessions = self._sessions
        if missing_ok:
            found = [session for session in map(sessions.get, session_ids) if session is not None]
        else:
            found = [self.get(session_id) for session_id in session_ids]
        for session in found:
            session.closing = True
        for session in found:
            if session.in_flight:
                await session.wait_idle()
            sessions.pop(session.id, None)

    async def chat(self, session_id: str, body: bytes) -> ChatOutcome:
        """One turn from a request body (JSON bytes, as an HTTP agent sends it)."""
        session = self.get(session_id)
        return await self._turn(session, normalize_chat_request(body, session.history))

    async def chat_object(self, session_id: str, body: dict[str, Any]) -> ChatOutcome:
        """One turn from a request body already parsed (an agent in this process): the same
        validation, the same pipeline, no JSON."""
        session = self.get(session_id)
        return await self._turn(session, normalize_chat_object(body, session.history))

    async def chat_many(self, turns: Sequence[tuple[str, dict[str, Any]]], *,
                        seeds: Sequence[int | None] | None = None) -> list[ChatOutcome | SessionError]:
        """One turn in each of many sessions, from parsed bodies (an agent in this process driving
        a batch of sessions in step), in one call: each turn is validated, planned and committed
        as :meth:`chat_object` does it and fails alone -- its error in its place, its session
        unchanged -- and the turns that pass reach the upstream together
        (:meth:`~miles_core.session.upstream.Upstream.generate_many`). A body that repeats the
        one before it but for its ``seed`` (a GRPO group's, one after another) is not validated
        again, nor is its conversation rendered again. ``seeds[i]``, when given, is turn ``i``'s
        ``seed``, as if its body held it (:func:`~miles_core.session.normalize.normalize_chat_objects`):
        a group's turns may then share one body object."""
        return await self._chat_batch(turns, replies=True, seeds=seeds)  # type: ignore[return-value]  # replies: outcomes

    async def chat_turns(self, turns: Sequence[tuple[str, dict[str, Any]]], *,
                         seeds: Sequence[int | None] | None = None) -> list[ChatTurn | SessionError]:
        """:meth:`chat_many` answering each turn with only what an agent in this process reads of
        the reply (:class:`~miles_core.session.completion.ChatTurn`): nothing is kept for an HTTP
        reply that no one will send."""
        return await self._chat_batch(turns, replies=False, seeds=seeds)  # type: ignore[return-value]  # no replies: chat turns

    async def _chat_batch(self, turns: Sequence[tuple[str, dict[str, Any]]], *, replies: bool,
                          seeds: Sequence[int | None] | None) -> list[ChatOutcome | ChatTurn | SessionError]:
        """:meth:`chat_many` (``replies``) or :meth:`chat_turns`: :meth:`_turn`'s steps
        (:meth:`_start`, the upstream, :meth:`_commit`) for a batch, with one upstream call for all
        and no object per turn beyond what the turn keeps (a step's turns are hundreds of
        sessions' first turns)."""
        results: list[ChatOutcome | ChatTurn | SessionError | None] = [None] * len(turns)
        known = self._sessions.get
        sessions = [known(session_id) for session_id, _ in turns]
        requests, sent = normalize_chat_batch(
            [body for _, body in turns],
            # Session.history, without building a history for a session that has none
            [None if session is None or (session._last_turn is None and session._history is None) else session.history
             for session in sessions],
            seeds,
        )
        tokenizer = _SharedRenders(self.tokenizer)
        pending: list[tuple[int, Session, Plan, ChatRequest]] = []
        calls: list[UpstreamCall] = []
        try:
            for index, (session, request, seed) in enumerate(zip(sessions, requests, sent)):
                if session is None:
                    results[index] = SessionNotFound(f"no session {turns[index][0][:64]!r}")
                    continue
                if isinstance(request, SessionError):
                    results[index] = request
                    continue
                try:
                    plan = self._start(session, request, tokenizer)
                except SessionError as exc:
                    results[index] = exc
                    continue
                pending.append((index, session, plan, request))
                calls.append((request, plan.prompt_ids, session.id, seed))
            del requests, sent, tokenizer
            generations = await self.upstream.generate_many(calls) if calls else []
        except BaseException:
            for _, session, _, _ in pending:
                session.end_generation()
            raise
        del calls
        committing = iter(zip(pending, generations, strict=True))
        try:
            for (index, session, plan, request), generation in committing:
                if isinstance(generation, SessionError):
                    session.end_generation()
                    results[index] = generation
                    continue
                try:
                    self._commit(session, plan, request.messages, request.keys, request.repeated, generation)
                except SessionError as exc:
                    results[index] = exc
                    continue
                completion = generation.completion
                results[index] = (
                    ChatOutcome(completion, request.stream, request.include_usage, generation.reply) if replies
                    else ChatTurn(completion.message, completion.finish_reason)
                )
        finally:  # after an unexpected error, the turns not reached give their slots back
            for (_, session, _, _), _ in committing:
                session.end_generation()
        return results  # type: ignore[return-value]  # every index was filled above

    async def _turn(self, session: Session, request: ChatRequest) -> ChatOutcome:
        plan = self._start(session, request, self.tokenizer)
        # what the commit and the reply need of the request: the upstream drops the parsed body
        # once it has what it needs
        messages, keys, repeated = request.messages, request.keys, request.repeated
        stream, include_usage = request.stream, request.include_usage
        try:
            call = self.upstream.generate(request, plan.prompt_ids, routing_key=session.id)
            del request
            generation = await call
        except BaseException:
            session.end_generation()
            raise
        self._commit(session, plan, messages, keys, repeated, generation)
        return ChatOutcome(generation.completion, stream, include_usage, generation.reply)

    def _start(self, session: Session, request: ChatRequest, tokenizer: PromptTokenizer) -> Plan:
        """Take a generation slot and plan the turn (the slot is given back if planning fails)."""
        session.begin_generation(self.version.max_in_flight)
        try:
            return session.store.plan(request, tokenizer)
        except BaseException:
            session.end_generation()
            raise

    @staticmethod
    def _commit(session: Session, plan: Plan, messages: tuple[Message, ...], keys: tuple[MessageKey, ...],
                repeated: int, generation: Generation) -> None:
        """Record the generated turn and give the generation slot back."""
        try:
            turn = session.store.commit(plan, generation.completion, generation.record)
            session.committed_tokens += len(turn.token_ids)
            session.committed(messages, keys, generation.completion.message, repeated)
        finally:
            session.end_generation()

    def sample_job(self, session_id: str, body: bytes) -> tuple[Session, SampleOptions]:
        """Validate a samples request; assembling (``assemble``) may then run off the event loop."""
        return self.get(session_id), normalize_samples_request(body)

    def samples(self, session_id: str, options: SampleOptions | None = None) -> SampleBatch:
        """The session's training samples, typed (an in-process caller)."""
        return self.get(session_id).store.samples(options or SampleOptions())

    def samples_many(self, session_ids: Sequence[str], options: SampleOptions | None = None) -> list[SampleBatch]:
        """:meth:`samples` of each session; an unknown one raises 404 before any is assembled."""
        known = self._sessions.get
        sessions = [known(session_id) for session_id in session_ids]
        if None in sessions:
            self.get(session_ids[sessions.index(None)])  # raises, naming it
        stores = [session.store for session in sessions]  # type: ignore[union-attr]  # none is None
        options = options or SampleOptions()
        return [store.samples(options) for store in stores]

    def assemble(self, session: Session, options: SampleOptions) -> dict[str, Any]:
        batch = session.store.samples(options).to_dict()
        return {"session_id": session.id, "version": self.version.name, **batch}


class _SharedRenders:
    """The service's tokenizer for one :meth:`SessionService.chat_many` call: a conversation
    rendered for one session is reused for the next that sends the very same objects (the
    sessions of a GRPO group, one after another, whose requests share their canonical messages;
    one call is one moment, also for a template that reads the clock)."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self._tokenizer = tokenizer
        self.family: TemplateFamily = tokenizer.family
        self.vocab_size = tokenizer.vocab_size
        # the last rendering and its arguments (held: compared by identity)
        self._last: tuple[Any, Any, Any, tuple[int, ...]] | None = None

    def render_prompt(
        self, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None, template_kwargs: Mapping[str, Any]
    ) -> tuple[int, ...]:
        last = self._last
        if last is not None and messages is last[0] and tools is last[1] and template_kwargs is last[2]:
            return last[3]
        ids = self._tokenizer.render_prompt(messages, tools=tools, template_kwargs=template_kwargs)
        self._last = (messages, tools, template_kwargs, ids)
        return ids

    def render_append(
        self,
        completion_ids: Sequence[int],
        messages: Sequence[Message],
        *,
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
    ) -> Appended:
        return self._tokenizer.render_append(completion_ids, messages, tools=tools, template_kwargs=template_kwargs)
