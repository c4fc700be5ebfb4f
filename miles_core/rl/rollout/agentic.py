"""The agentic rollout path: episodes speak OpenAI chat through the session service.

Each episode opens a session, sends the prompt's messages as chat completions (multi-turn: tool
calls the model makes are run in the sandbox and their results appended as ``tool`` messages,
up to ``rollout.max_turns`` assistant turns), then asks the session for its training samples --
the exact token ids, loss mask and log-probs the engine sampled, never re-tokenized -- and closes
the session.

In ``miles train`` the session service runs in this process in front of the embedded engine
(:class:`~miles_core.session.client.LocalSessions`): the code that serves external agents over
HTTP, minus the transport -- no JSON between engine, session and trainer, no server threads. A
session server elsewhere (a Ray engine actor's) is reached over HTTP with the same client
interface (:class:`~miles_core.session.client.HTTPSessions`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.config import RolloutSection, TrainConfig
from miles_core.rl.rollout.base import RolloutContext, Tokenizer
from miles_core.rl.rollout.types import Trajectory, sample_seed
from miles_core.rl.sandboxes import SandboxCallError, WarmSandbox, tool_sandbox_settings
from miles_core.rl.tasks import Prompt, SandboxTool
from miles_core.session.client import HTTPSessions, SessionCallError, SessionClient

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager


class EpisodeError(RuntimeError):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


#: a chat turn the session answered 502 (its upstream failed) is sent again, in the same session:
#: a failed turn changes nothing there, and the same seed samples the same tokens
UPSTREAM_RETRIES = 2


class AgenticRollout:
    """``sessions``: a session client, or the base URL of a session server."""

    def __init__(self, sessions: SessionClient | str, tokenizer: Tokenizer, settings: RolloutSection, run_seed: int,
                 aio: BackgroundLoop, tools: Sequence[SandboxTool] = (), sandbox: WarmSandbox | None = None) -> None:
        self.sessions: SessionClient = (
            HTTPSessions(sessions, max_connections=settings.concurrency) if isinstance(sessions, str) else sessions
        )
        self.tokenizer = tokenizer
        self.settings = settings
        self.run_seed = run_seed
        self.aio = aio
        self.tools = {t.name: t for t in tools}
        self.sandbox = sandbox
        self.label = f"session_{settings.session_version}"
        self._tool_schemas = [t.schema() for t in tools]
        self._first_tokens: dict[int, str] = {}
        self._closers: list[Callable[[], None]] = []

    @classmethod
    def start(cls, context: RolloutContext) -> AgenticRollout:
        """Episodes against ``context.session_url`` when the orchestrator runs a session server;
        otherwise sessions in this process in front of the embedded engine (no servers)."""
        from miles_core.session.client import LocalSessions

        config, aio, pm = context.config, context.aio, context.pm
        sessions: SessionClient | str
        if context.session_url:
            sessions = context.session_url
        else:
            from miles_core.engine.engine import Engine

            if not isinstance(context.engine, Engine):
                raise TypeError(f"in-process sessions need the embedded Engine, not {type(context.engine).__name__}: "
                                "an orchestrator with another engine passes RolloutContext.session_url")
            sessions = LocalSessions.for_engine(context.engine, context.model_dir, version=config.rollout.session_version, pm=pm)
        sandbox = tool_sandbox(config, pm, aio, context.task.tools)
        try:
            rollout = cls(sessions, context.tokenizer, config.rollout, config.run.seed, aio, context.task.tools, sandbox)
        except BaseException:
            if sandbox is not None:
                sandbox.close()
            raise
        if sandbox is not None:
            rollout._closers.append(sandbox.close)
        return rollout

    def run(self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0) -> list[Trajectory]:
        """One episode per prompt, seeded like :meth:`DirectRollout.run`."""
        return self.aio.run(self._run_all(prompts, step, first_index))

    async def _run_all(self, prompts: Sequence[Prompt], step: int, first_index: int) -> list[Trajectory]:
        limit = asyncio.Semaphore(self.settings.concurrency)

        async def one(index: int, prompt: Prompt) -> Trajectory:
            async with limit:
                return await self._episode(prompt, sample_seed(self.run_seed, step, index))

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts, start=first_index))))

    async def _episode(self, prompt: Prompt, seed: int) -> Trajectory:
        s = self.settings
        sessions = self.sessions
        try:
            session_id = await sessions.create()
        except SessionCallError as exc:
            raise EpisodeError(str(exc), exc.status) from None
        try:
            messages = prompt.chat()
            turns = 0
            while True:
                body: dict[str, Any] = {
                    "messages": messages, "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                    "top_p": s.top_p, "top_k": s.top_k, "seed": (seed + turns) % 2**63,
                }
                if self._tool_schemas:
                    body["tools"] = self._tool_schemas
                reply = await self._chat(session_id, body)
                turns += 1
                calls = reply.message.get("tool_calls") or []
                if not calls or turns >= s.max_turns:
                    break
                messages = [*messages, reply.message, *[await self._call_tool(c) for c in calls]]
            samples = await sessions.samples(session_id)
        except SessionCallError as exc:
            raise EpisodeError(str(exc), exc.status) from None
        finally:
            await sessions.delete(session_id)
        if len(samples) != 1:
            raise EpisodeError(f"expected one sample per linear episode, got {len(samples)}")
        sample = samples[0]
        tokens, n = tuple(sample.tokens), sample.response_length
        return Trajectory(
            prompt=prompt,
            token_ids=tokens,
            response_length=n,
            loss_mask=tuple(sample.loss_mask),
            rollout_logprobs=tuple(sample.rollout_log_probs),
            completion=reply.message.get("content") or "",
            first_token=self._first_token(tokens[len(tokens) - n]) if n else "",
            turns=turns,
            finish_reason=reply.finish_reason or "",
            weight_version=",".join(sorted({str(v) for v in sample.weight_versions})),
        )

    def _first_token(self, token_id: int) -> str:
        text = self._first_tokens.get(token_id)
        if text is None:
            text = self._first_tokens[token_id] = self.tokenizer.decode([token_id])
        return text

    async def _chat(self, session_id: str, body: dict[str, Any]) -> Any:
        failures = 0
        while True:
            try:
                return await self.sessions.chat(session_id, body)
            except SessionCallError as exc:
                failures += 1
                if exc.status != 502 or failures > UPSTREAM_RETRIES:
                    raise EpisodeError(str(exc), exc.status) from None

    async def _call_tool(self, call: dict[str, Any]) -> dict[str, Any]:
        """Run one tool call in the sandbox. Unknown tools, bad arguments and a tool program that
        fails on them become tool messages the model sees (the policy's mistakes, not the run's);
        a sandbox that cannot run at all raises."""
        fn = call.get("function") or {}
        tool = self.tools.get(fn.get("name", ""))
        if tool is None or self.sandbox is None:
            content = f"error: unknown tool {fn.get('name')!r}"
        else:
            args = fn.get("arguments") or "{}"
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
                content = await self.sandbox.call(f"tool_{tool.name}.py", parsed, f"tool {tool.name!r}")
            except json.JSONDecodeError as exc:
                content = f"error: arguments are not JSON ({exc})"
            except SandboxCallError as exc:
                content = f"error: {exc}"
        return {"role": "tool", "tool_call_id": call.get("id") or "", "content": content}

    def close(self) -> None:
        self.aio.run(self.sessions.aclose())
        for close in reversed(self._closers):
            close()


def tool_sandbox(config: TrainConfig, pm: MilesPluginManager, aio: BackgroundLoop,
                 tools: Sequence[SandboxTool]) -> WarmSandbox | None:
    """A warm sandbox with every tool's program installed (``None`` when there are no tools)."""
    if not tools:
        return None
    provider, options = tool_sandbox_settings(config.reward)
    sandbox = aio.run(WarmSandbox(pm, provider, "tools", aio, config.reward.timeout_s, options).start())
    for tool in tools:
        aio.run(sandbox.install(f"tool_{tool.name}.py", tool.program))
    return sandbox
