"""Clients of the session service for agents written in Python (the agentic rollout of
``miles train``): one interface, two transports.

* :class:`LocalSessions` calls a :class:`~miles_core.session.service.SessionService` in this
  process: the same normalizer, stores and upstream that serve HTTP agents, minus the transport
  -- no JSON, no sockets, typed turns and samples. :meth:`LocalSessions.for_engine` puts it in
  front of the embedded engine (:class:`~miles_core.session.upstream.EngineUpstream`).
* :class:`HTTPSessions` speaks the session server's HTTP API (a server in another process, e.g.
  the one a Ray engine actor runs), over miles' own HTTP pool.

Both raise :class:`SessionCallError` carrying the HTTP status the call got (or would have got).
They belong to the event loop that first uses them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from miles_core.errors import MilesError
from miles_core.session.errors import SessionError, SessionNotFound
from miles_core.session.trajectory import Sample, SampleOptions

if TYPE_CHECKING:
    from miles_core.engine.engine import Engine
    from miles_core.plugins import MilesPluginManager
    from miles_core.session.service import SessionService


class SessionCallError(MilesError):
    """A session call failed; ``status`` is the HTTP status it got (or would have got; 0 when no
    reply came back)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ChatTurn:
    """What an agent needs from a chat reply."""

    message: dict[str, Any]  # the assistant message, as an agent appends it to its history
    finish_reason: str | None


class SessionClient(Protocol):
    async def create(self) -> str: ...

    async def chat(self, session_id: str, body: dict[str, Any]) -> ChatTurn: ...

    async def samples(self, session_id: str) -> list[Sample]: ...

    async def delete(self, session_id: str) -> None: ...

    async def aclose(self) -> None: ...


class LocalSessions:
    """The session service in this process (see the module doc)."""

    def __init__(self, service: SessionService) -> None:
        self.service = service

    @classmethod
    def for_engine(
        cls,
        engine: Engine,
        tokenizer_dir: str | Path,
        *,
        version: str = "v1",
        pm: MilesPluginManager | None = None,
        max_sessions: int = 10_000,
        timeout: float = 600.0,
    ) -> LocalSessions:
        """Sessions of ``version`` over the embedded ``engine`` called in-process; prompts are
        rendered with the tokenizer and chat template in ``tokenizer_dir``."""
        from miles_core.session.config import ServiceLimits
        from miles_core.session.service import SessionService, activate_version
        from miles_core.session.tokenizer import ChatTokenizer
        from miles_core.session.upstream import EngineUpstream

        session_version = activate_version(version, pm)
        tokenizer = ChatTokenizer.from_dir(tokenizer_dir)
        upstream = EngineUpstream(engine, vocab_size=tokenizer.vocab_size, timeout=timeout)
        return cls(SessionService(session_version, tokenizer, upstream, limits=ServiceLimits(max_sessions=max_sessions)))

    async def create(self) -> str:
        try:
            return self.service.create()
        except SessionError as exc:
            raise _failed("POST /sessions", exc) from None

    async def chat(self, session_id: str, body: dict[str, Any]) -> ChatTurn:
        try:
            outcome = await self.service.chat_object(session_id, body)
        except SessionError as exc:
            raise _failed(f"POST /sessions/{session_id}/v1/chat/completions", exc) from None
        return ChatTurn(outcome.completion.message, outcome.completion.finish_reason)

    async def samples(self, session_id: str) -> list[Sample]:
        try:
            return self.service.samples(session_id, SampleOptions()).samples
        except SessionError as exc:
            raise _failed(f"POST /sessions/{session_id}/samples", exc) from None

    async def delete(self, session_id: str) -> None:
        """Close the session (one that is already gone is fine, as over HTTP)."""
        try:
            await self.service.delete(session_id)
        except SessionNotFound:
            return

    async def aclose(self) -> None:
        await self.service.upstream.aclose()


class HTTPSessions:
    """A session server over HTTP (see the module doc); ``url`` is its base URL."""

    def __init__(self, url: str, *, max_connections: int = 64, timeout: float = 600.0) -> None:
        from miles_core import __version__
        from miles_core.engine.http import HTTPPool

        self.url = url.rstrip("/")
        headers = {"user-agent": f"miles/{__version__}", "accept": "application/json", "content-type": "application/json"}
        # between steps the connections sit idle while the trainer works; the session server
        # keeps them for 75 s (embed.KEEP_ALIVE_S) and the pool polls each one before reuse
        self._pool = HTTPPool(
            self.url, headers=headers, timeout=timeout, connect_timeout=10.0, max_connections=max_connections, keepalive_s=60.0
        )

    async def create(self) -> str:
        return (await self._call("POST", "/sessions", {}))["session_id"]

    async def chat(self, session_id: str, body: dict[str, Any]) -> ChatTurn:
        choice = (await self._call("POST", f"/sessions/{session_id}/v1/chat/completions", body))["choices"][0]
        return ChatTurn(choice["message"], choice.get("finish_reason"))

    async def samples(self, session_id: str) -> list[Sample]:
        batch = await self._call("POST", f"/sessions/{session_id}/samples", {})
        return [Sample(**sample) for sample in batch["samples"]]

    async def delete(self, session_id: str) -> None:
        await self._call("DELETE", f"/sessions/{session_id}", None, ok=(204, 404))

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def _call(self, method: str, path: str, body: Any, *, ok: Sequence[int] = (200,)) -> Any:
        import httpx

        content = None if body is None else json.dumps(body).encode()
        try:
            status, reply = await self._pool.exchange(method, path, {}, content)
        except httpx.HTTPError as exc:
            raise SessionCallError(f"session server {method} {path}: {type(exc).__name__}: {exc}", 0) from exc
        if status not in ok:
            raise SessionCallError(f"session server {method} {path}: HTTP {status}: {reply[:300].decode(errors='replace')}", status)
        return json.loads(reply) if status == 200 else None


def _failed(call: str, exc: SessionError) -> SessionCallError:
    return SessionCallError(f"session {call}: HTTP {exc.status}: {exc.message[:300]}", exc.status)
