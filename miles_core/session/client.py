"""Clients of the session service for agents written in Python (the agentic rollout of
``miles train``): one interface, two transports.

* :class:`LocalSessions` calls a :class:`~miles_core.session.service.SessionService` in this
  process: the same normalizer, stores and upstream that serve HTTP agents, minus the transport
  -- no JSON, no sockets, typed turns and samples. :meth:`LocalSessions.for_engine` puts it in
  front of the embedded engine (:class:`~miles_core.session.upstream.EngineUpstream`).
* :class:`HTTPSessions` speaks the session server's HTTP API (a server in another process, e.g.
  the one a Ray engine actor runs), over miles' own HTTP pool.

(The Ray orchestrator adds a third for its rollout workers: the engine actor's in-process service
called with Ray, :class:`~miles_core.rl.orchestrators.ray.RaySessions`.)

Both raise :class:`SessionCallError` carrying the HTTP status the call got (or would have got).
They belong to the event loop that first uses them.

Besides one call per session (``create``, ``chat``, ``samples``, ``delete``), both take a batch of
sessions in one call per phase (``create_many``, ``chat_many``, ``samples_many``,
``delete_many``): in this process one call into the service (one engine submission for a
batch of turns); over HTTP concurrent requests, one per session.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from miles_core.errors import MilesError
from miles_core.session.completion import ChatTurn
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

    def __reduce__(self) -> tuple[type[SessionCallError], tuple[str, int]]:
        # pickled with its status (a Ray actor's session calls return these), not just the message
        return type(self), (str(self), self.status)


class SessionClient(Protocol):
    async def create(self) -> str: ...

    async def chat(self, session_id: str, body: dict[str, Any]) -> ChatTurn: ...

    async def samples(self, session_id: str) -> list[Sample]: ...

    async def delete(self, session_id: str) -> None: ...

    async def create_many(self, n: int) -> list[str]:
        """``n`` new sessions (none left open when it raises)."""
        ...

    async def chat_many(self, turns: Sequence[tuple[str, dict[str, Any]]], *,
                        seeds: Sequence[int | None] | None = None) -> list[ChatTurn | SessionCallError]:
        """One turn per ``(session_id, body)``, each as :meth:`chat` answers it: its
        :class:`SessionCallError` in its place when it fails (the others go on). ``seeds[i]``,
        when given, is turn ``i``'s ``seed``, as if its body held it (``{**body, "seed":
        seeds[i]}``): the turns of a GRPO group may share one body object."""
        ...

    async def samples_many(self, session_ids: Sequence[str]) -> list[list[Sample]]:
        """:meth:`samples` of each session."""
        ...

    async def delete_many(self, session_ids: Sequence[str]) -> None:
        """:meth:`delete` of each session (those already gone are fine)."""
        ...

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

    async def create_many(self, n: int) -> list[str]:
        try:
            return self.service.create_many(n)
        except SessionError as exc:
            raise _failed("POST /sessions", exc) from None

    async def chat_many(self, turns: Sequence[tuple[str, dict[str, Any]]], *,
                        seeds: Sequence[int | None] | None = None) -> list[ChatTurn | SessionCallError]:
        """The turns as one :meth:`~miles_core.session.service.SessionService.chat_turns`."""
        out: list[ChatTurn | SessionCallError] = await self.service.chat_turns(turns, seeds=seeds)  # type: ignore[assignment]  # errors replaced below
        for index, turn in enumerate(out):
            if type(turn) is not ChatTurn:
                out[index] = _failed(f"POST /sessions/{turns[index][0]}/v1/chat/completions", turn)  # type: ignore[arg-type]  # a SessionError
        return out

    async def samples_many(self, session_ids: Sequence[str]) -> list[list[Sample]]:
        try:
            return [batch.samples for batch in self.service.samples_many(session_ids, SampleOptions())]
        except SessionError as exc:
            raise _failed("POST /sessions/{id}/samples", exc) from None

    async def delete_many(self, session_ids: Sequence[str]) -> None:
        await self.service.delete_many(session_ids, missing_ok=True)

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

    async def create_many(self, n: int) -> list[str]:
        created = await asyncio.gather(*(self.create() for _ in range(n)), return_exceptions=True)
        failed = [result for result in created if isinstance(result, BaseException)]
        if failed:  # none left open
            await self.delete_many([result for result in created if isinstance(result, str)])
            raise failed[0]
        return created  # type: ignore[return-value]  # all str: no failure

    async def chat_many(self, turns: Sequence[tuple[str, dict[str, Any]]], *,
                        seeds: Sequence[int | None] | None = None) -> list[ChatTurn | SessionCallError]:
        async def one(session_id: str, body: dict[str, Any]) -> ChatTurn | SessionCallError:
            try:
                return await self.chat(session_id, body)
            except SessionCallError as exc:
                return exc

        if seeds is not None:
            turns = [(session_id, {**body, "seed": seed}) for (session_id, body), seed in zip(turns, seeds, strict=True)]
        return list(await asyncio.gather(*(one(session_id, body) for session_id, body in turns)))

    async def samples_many(self, session_ids: Sequence[str]) -> list[list[Sample]]:
        return list(await asyncio.gather(*map(self.samples, session_ids)))

    async def delete_many(self, session_ids: Sequence[str]) -> None:
        await asyncio.gather(*map(self.delete, session_ids))

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
