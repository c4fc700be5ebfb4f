"""The session service: the registry of sessions and the chat pipeline, independent of HTTP.

One chat turn::

    normalize (pure, 400)  ->  store.plan (pure: 400/409/422)  ->  engine call (502)
        ->  extract_completion (502)  ->  store.commit (the only mutation)

Everything before ``commit`` is free of side effects, so a request that is rejected or fails
upstream leaves the session byte-identical. Between the ``await`` on the engine and the commit
nothing else runs on the event loop, so stores need no locks; a version's ``max_in_flight``
bounds concurrent generations per session (409 beyond it, never a silent drop).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from miles_core import strict_json
from miles_core.engine.client import EngineClient, EngineError, EngineHTTPError
from miles_core.session.base import PromptTokenizer, SessionVersion, TrajectoryStore
from miles_core.session.completion import client_reply, extract_completion
from miles_core.session.config import ServiceLimits
from miles_core.session.errors import Conflict, InvalidRequest, SessionError, SessionNotFound, UpstreamFailure
from miles_core.session.normalize import (
    normalize_chat_request,
    normalize_samples_request,
    parse_json_object,
    upstream_body,
)
from miles_core.session.trajectory import SampleOptions, TurnRecord


@dataclass(frozen=True)
class ChatOutcome:
    reply: dict[str, Any]  # what the agent receives (replay data stripped)
    stream: bool
    include_usage: bool


class Session:
    def __init__(self, session_id: str, store: TrajectoryStore) -> None:
        self.id = session_id
        self.store = store
        self.in_flight = 0
        self.closing = False
        #: tokens in the snapshots of every committed turn: at least what assembling samples reads
        self.committed_tokens = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextmanager
    def generation(self, max_in_flight: int | None) -> Iterator[None]:
        """Hold one generation slot for the duration of a chat turn."""
        if self.closing:
            raise Conflict(f"session {self.id} is being deleted")
        if max_in_flight is not None and self.in_flight >= max_in_flight:
            raise Conflict(
                f"session {self.id} already has {self.in_flight} generation(s) in flight and its version "
                f"allows {max_in_flight}; send the next request after the reply"
            )
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


class SessionService:
    def __init__(
        self,
        version: SessionVersion,
        tokenizer: PromptTokenizer,
        engine: EngineClient,
        *,
        limits: ServiceLimits | None = None,
    ) -> None:
        self.version = version
        self.tokenizer = tokenizer
        self.engine = engine
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
        session = self.get(session_id)
        request = normalize_chat_request(body)
        stream, include_usage = request.stream, request.include_usage
        with session.generation(self.version.max_in_flight):
            plan = session.store.plan(request, self.tokenizer)
            try:
                sent = strict_json.dumps(upstream_body(request, plan.prompt_ids))
            except ValueError as exc:
                raise InvalidRequest(f"the request cannot be forwarded upstream: {exc}") from None
            # The parsed history is not needed while the engine generates. Released now, its
            # ~100 objects per session in flight stay out of every young garbage collection.
            del request
            started = time.time()
            try:
                reply, received = await self.engine.chat_completions_raw(sent, routing_key=session.id)
            except EngineError as exc:
                raise upstream_error(exc) from exc
            completion = extract_completion(reply, vocab_size=self.tokenizer.vocab_size)
            turn = session.store.commit(plan, completion, TurnRecord(sent, received, started, time.time()))
            session.committed_tokens += len(turn.token_ids)
        return ChatOutcome(client_reply(reply), stream, include_usage)

    def sample_job(self, session_id: str, body: bytes) -> tuple[Session, SampleOptions]:
        """Validate a samples request; assembling (``assemble``) may then run off the event loop."""
        return self.get(session_id), normalize_samples_request(body)

    def assemble(self, session: Session, options: SampleOptions) -> dict[str, Any]:
        batch = session.store.samples(options).to_dict()
        return {"session_id": session.id, "version": self.version.name, **batch}


def upstream_error(exc: EngineError) -> SessionError:
    """An engine failure as the agent sees it: its own request rejected (400) or upstream (502)."""
    if isinstance(exc, EngineHTTPError) and exc.status_code in (400, 422):
        return InvalidRequest(f"the engine rejected the request: {exc.detail}")
    return UpstreamFailure(f"{type(exc).__name__}: {exc.detail}")
