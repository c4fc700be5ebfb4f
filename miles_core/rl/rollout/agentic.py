"""The agentic rollout path: episodes speak OpenAI chat through the session service.

Each episode opens a session, sends the prompt's messages as chat completions (multi-turn: tool
calls the model makes are run in the sandbox and their results appended as ``tool`` messages,
up to ``rollout.max_turns`` assistant turns), then asks the session for its training samples --
the exact token ids, loss mask and log-probs the engine sampled, never re-tokenized -- and closes
the session.

A step's episodes advance together, one client call per phase for all of them: open the
sessions, send every episode's next turn, run the tool calls of those that made some (each
episode's in order, episodes at once), repeat while any continues, take the samples, close the
sessions. ``rollout.concurrency`` caps the episodes in flight (they then go in groups of that
many, one group after another); unset, a step's episodes all go at once.

In ``miles train`` the session service runs in this process in front of the embedded engine
(:class:`~miles_core.session.client.LocalSessions`): the code that serves external agents over
HTTP, minus the transport -- no JSON between engine, session and trainer, no server threads, and
a phase's turns reach the engine as one batch. Under Ray the same service runs in the engine
actor and a rollout worker calls it with Ray, a phase's turns again one batch
(:class:`~miles_core.rl.orchestrators.ray.RaySessions`). A session server given only by URL is
reached over HTTP with the same client interface (:class:`~miles_core.session.client.HTTPSessions`),
a phase's calls as concurrent requests.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.config import RolloutSection, TrainConfig
from miles_core.rl.rollout.base import RolloutContext, Tokenizer
from miles_core.rl.rollout.types import Trajectory, sample_seeds
from miles_core.rl.sandboxes import SandboxCallError, WarmSandbox, tool_sandbox_settings
from miles_core.rl.tasks import Prompt, SandboxTool
from miles_core.session.client import ChatTurn, HTTPSessions, SessionCallError, SessionClient

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager
    from miles_core.session.trajectory import Sample


class EpisodeError(RuntimeError):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


#: a chat turn the session answered 502 (its upstream failed) is sent again, in the same session:
#: a failed turn changes nothing there, and the same seed samples the same tokens
UPSTREAM_RETRIES = 2
#: connections to a session server when ``rollout.concurrency`` is unset
HTTP_CONNECTIONS = 64
#: containers (objects the cyclic garbage collector tracks) an episode allocates that live until
#: its group's sessions are closed: ~30 on the tiny preset in this process, with room for more
GC_CONTAINERS_PER_EPISODE = 64


@contextmanager
def young_collections_deferred(containers: int) -> Iterator[None]:
    """The garbage collector's first threshold raised to at least ``containers`` meanwhile.

    A group's episodes allocate their state (sessions, turns, completions, records, samples) at
    once, and it lives until the sessions close. A young collection every 700 allocations (the
    default) scans all of it as it accumulates and promotes it, to be scanned again a generation
    up -- ~10 % of the Python an in-process episode costs on the tiny preset (steps alternating
    with and without, one process) -- although none of it is cyclic garbage: closing the sessions
    frees it by reference counting. Above what the group allocates, a collection comes only after
    it is freed; allocations beyond that still trigger one.
    """
    threshold = gc.get_threshold()
    if containers <= threshold[0]:
        yield
        return
    gc.set_threshold(containers, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


class AgenticRollout:
    """``sessions``: a session client, or the base URL of a session server."""

    def __init__(self, sessions: SessionClient | str, tokenizer: Tokenizer, settings: RolloutSection, run_seed: int,
                 aio: BackgroundLoop, tools: Sequence[SandboxTool] = (), sandbox: WarmSandbox | None = None) -> None:
        self.sessions: SessionClient = (
            HTTPSessions(sessions, max_connections=settings.concurrency or HTTP_CONNECTIONS)
            if isinstance(sessions, str) else sessions
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
        """Episodes through the orchestrator's session client (``context.sessions``) or, failing
        that, its session server (``context.session_url``); otherwise sessions in this process in
        front of the embedded engine (no servers)."""
        from miles_core.session.client import LocalSessions

        config, aio, pm = context.config, context.aio, context.pm
        sessions: SessionClient | str
        if context.sessions is not None:
            sessions = context.sessions
        elif context.session_url:
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
        seeds = sample_seeds(self.run_seed, step, first_index, len(prompts))
        group = self.settings.concurrency or max(1, len(prompts))
        out: list[Trajectory] = []
        with young_collections_deferred(min(group, len(prompts)) * GC_CONTAINERS_PER_EPISODE):
            for lo in range(0, len(prompts), group):
                out += await self._episodes(prompts[lo : lo + group], seeds[lo : lo + group])
        return out

    async def _episodes(self, prompts: Sequence[Prompt], seeds: Sequence[int]) -> list[Trajectory]:
        """Episodes in step (see the module doc)."""
        sessions, max_turns = self.sessions, self.settings.max_turns
        try:
            ids = await sessions.create_many(len(prompts))
        except SessionCallError as exc:
            raise EpisodeError(str(exc), exc.status) from None
        try:
            # the episodes of one prompt send the very same opening messages (validated once)
            openings: dict[int, list[dict[str, Any]]] = {}
            conversations = []
            for prompt in prompts:
                opening = openings.get(id(prompt))
                if opening is None:
                    opening = openings[id(prompt)] = prompt.chat()
                conversations.append(opening)
            replies: list[ChatTurn] = [None] * len(prompts)  # type: ignore[list-item]  # each set by its first turn
            turns = [0] * len(prompts)
            active = list(range(len(prompts)))
            while active:
                await self._chat_round(ids, active, conversations, seeds, turns, replies)
                active = [i for i in active if replies[i].message.get("tool_calls") and turns[i] < max_turns]
                results = await asyncio.gather(*(self._call_tools(replies[i].message["tool_calls"]) for i in active))
                for i, tool_messages in zip(active, results):
                    conversations[i] = [*conversations[i], replies[i].message, *tool_messages]
            samples = await sessions.samples_many(ids)
        except SessionCallError as exc:
            raise EpisodeError(str(exc), exc.status) from None
        finally:
            await sessions.delete_many(ids)
        return self._trajectories(prompts, samples, replies, turns)

    async def _chat_round(self, ids: Sequence[str], active: Sequence[int], conversations: Sequence[list[dict[str, Any]]],
                          seeds: Sequence[int], turns: list[int], replies: list[ChatTurn]) -> None:
        """The next turn of every ``active`` episode, in one call (a turn that fails upstream, 502,
        is sent again, at most :data:`UPSTREAM_RETRIES` times)."""
        s, tools = self.settings, self._tool_schemas
        fields: dict[str, Any] = {"max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                                  "top_k": s.top_k, "seed": None}  # each turn's seed is sent in its place
        if tools:
            fields["tools"] = tools
        # one body per conversation object (a group's episodes share theirs until they diverge),
        # sent with each episode's own seed
        bodies: dict[int, dict[str, Any]] = {}
        failures: dict[int, int] = {}
        todo = list(active)
        while todo:
            turns_now, seeds_now = [], []
            for i in todo:
                conversation = conversations[i]
                body = bodies.get(id(conversation))
                if body is None:
                    body = bodies[id(conversation)] = {"messages": conversation, **fields}
                turns_now.append((ids[i], body))
                seeds_now.append((seeds[i] + turns[i]) % 2**63)
            retry = []
            for i, result in zip(todo, await self.sessions.chat_many(turns_now, seeds=seeds_now), strict=True):
                if isinstance(result, SessionCallError):
                    failures[i] = failures.get(i, 0) + 1
                    if result.status != 502 or failures[i] > UPSTREAM_RETRIES:
                        raise EpisodeError(str(result), result.status)
                    retry.append(i)
                else:
                    replies[i] = result
                    turns[i] += 1
            todo = retry

    def _trajectories(self, prompts: Sequence[Prompt], samples: Sequence[Sequence[Sample]], replies: Sequence[ChatTurn],
                      turns: Sequence[int]) -> list[Trajectory]:
        """Each episode's trajectory, from its one sample and its last reply."""
        out = []
        for prompt, episode, reply, turn_count in zip(prompts, samples, replies, turns, strict=True):
            if len(episode) != 1:
                raise EpisodeError(f"expected one sample per linear episode, got {len(episode)}")
            sample = episode[0]
            tokens, n, versions = tuple(sample.tokens), sample.response_length, sample.weight_versions
            first = self._first_token(tokens[len(tokens) - n]) if n else ""
            out.append(Trajectory(  # positional: one per episode
                prompt,
                tokens,
                n,
                tuple(sample.loss_mask),
                tuple(sample.rollout_log_probs),
                reply.message.get("content") or "",
                first,
                turn_count,
                reply.finish_reason or "",
                versions[0] if len(versions) == 1 and type(versions[0]) is str
                else ",".join(sorted({str(v) for v in versions})),
            ))
        return out

    def _first_token(self, token_id: int) -> str:
        """A token's text, decoded once per run."""
        text = self._first_tokens.get(token_id)
        if text is None:
            text = self._first_tokens[token_id] = self.tokenizer.decode([token_id])
        return text

    async def _call_tools(self, calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """One episode's tool calls, in order."""
        return [await self._call_tool(call) for call in calls]

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
