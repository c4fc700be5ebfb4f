"""The session service: the registry of sessions and the chat pipeline, independent of HTTP.

One chat turn::

    normalize (pure, 400)  ->  store.plan (pure: 400/409/422)  ->  upstream.generate (400/502)
        ->  store.commit (the only mutation)

The transports differ only at the two ends: the HTTP server (:mod:`.server`) hands in request
bytes (:meth:`SessionService.chat`) and an in-process caller a parsed body
(:meth:`SessionService.chat_object`); the upstream is an engine over HTTP or the embedded engine
in this process (:mod:`.upstream`). Everything before ``commit`` is free of side effects, so a
request that is rejected or fails upstream leaves the session byte-identical. Between the
``await`` on the engine and the commit nothing else runs on the event loop, so stores need no
locks; a version's ``max_in_flight`` bounds concurrent generations per session (409 beyond it,
never a silent drop).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_core.session.base import PromptTokenizer, SessionVersion, TrajectoryStore
from miles_core.session.completion import Completion
from miles_core.session.config import ServiceLimits
from miles_core.session.errors import Conflict, InvalidRequest, SessionNotFound
from miles_core.session.normalize import (
    ChatRequest,
    History,
    normalize_chat_object,
    normalize_chat_request,
    normalize_samples_request,
    parse_json_object,
)
from miles_core.session.trajectory import SampleBatch, SampleOptions
from miles_core.session.upstream import Upstream, upstream_error

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager

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


class Session:
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
    ) -> None:
        self.version = version
        self.tokenizer = tokenizer
        self.upstream = upstream
        self.limits = limits or ServiceLimits()
        self.instance_id = uuid.uuid4().hex
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
        if len(self._sessions) >= self.limits.max_sessions:
            raise Conflict(f"the server holds max_sessions={self.limits.max_sessions} sessions; delete finished ones")
        session_id = uuid.uuid4().hex
        self._sessions[session_id] = Session(session_id, self.version.create_store(max_turns=self.limits.max_turns))
        return session_id

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
        session = self.get(session_id)
        session.closing = True
        await session.wait_idle()
        self._sessions.pop(session_id, None)

    async def chat(self, session_id: str, body: bytes) -> ChatOutcome:
        """One turn from a request body (JSON bytes, as an HTTP agent sends it)."""
        session = self.get(session_id)
        return await self._turn(session, normalize_chat_request(body, session.history))

    async def chat_object(self, session_id: str, body: dict[str, Any]) -> ChatOutcome:
        """One turn from a request body already parsed (an agent in this process): the same
        validation, the same pipeline, no JSON."""
        session = self.get(session_id)
        return await self._turn(session, normalize_chat_object(body, session.history))

    async def _turn(self, session: Session, request: ChatRequest) -> ChatOutcome:
        session.begin_generation(self.version.max_in_flight)
        try:
            plan = session.store.plan(request, self.tokenizer)
            messages, keys, repeated = request.messages, request.keys, request.repeated
            stream, include_usage = request.stream, request.include_usage
            call = self.upstream.generate(request, plan.prompt_ids, routing_key=session.id)
            del request  # the upstream drops the parsed body once it has what it needs
            generation = await call
            turn = session.store.commit(plan, generation.completion, generation.record)
            session.committed_tokens += len(turn.token_ids)
            session.committed(messages, keys, generation.completion.message, repeated)
        finally:
            session.end_generation()
        return ChatOutcome(generation.completion, stream, include_usage, generation.reply)

    def sample_job(self, session_id: str, body: bytes) -> tuple[Session, SampleOptions]:
        """Validate a samples request; assembling (``assemble``) may then run off the event loop."""
        return self.get(session_id), normalize_samples_request(body)

    def samples(self, session_id: str, options: SampleOptions | None = None) -> SampleBatch:
        """The session's training samples, typed (an in-process caller)."""
        return self.get(session_id).store.samples(options or SampleOptions())

    def assemble(self, session: Session, options: SampleOptions) -> dict[str, Any]:
        batch = session.store.samples(options).to_dict()
        return {"session_id": session.id, "version": self.version.name, **batch}
