"""The agentic rollout path: episodes speak OpenAI chat through the session server.

Each episode opens a session, sends the prompt's messages as chat completions (multi-turn: tool
calls the model makes are run in the sandbox and their results appended as ``tool`` messages,
up to ``rollout.max_turns`` assistant turns), then asks the session server for its training
samples -- the exact token ids, loss mask and log-probs the engine sampled, never re-tokenized --
and closes the session. The session server runs in-process on a loopback port in front of the
embedded engine's HTTP server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from miles_core.rl.aio import BackgroundLoop
from miles_core.rl.config import RolloutSection, TrainConfig
from miles_core.rl.rollout.base import RolloutContext, Tokenizer
from miles_core.rl.rollout.types import Trajectory, sample_seed
from miles_core.rl.sandboxes import SandboxCallError, WarmSandbox, tool_sandbox_settings
from miles_core.rl.tasks import Prompt, SandboxTool

if TYPE_CHECKING:
    from miles_core.plugins import MilesPluginManager


class EpisodeError(RuntimeError):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


#: a chat turn the session server answered 502 (its upstream connection failed) is sent again, in
#: the same session: a failed turn changes nothing there, and the same seed samples the same tokens
UPSTREAM_RETRIES = 2


class AgenticRollout:
    def __init__(self, url: str, tokenizer: Tokenizer, settings: RolloutSection, run_seed: int, aio: BackgroundLoop,
                 tools: Sequence[SandboxTool] = (), sandbox: WarmSandbox | None = None) -> None:
        self.url = url
        self.tokenizer = tokenizer
        self.settings = settings
        self.run_seed = run_seed
        self.aio = aio
        self.tools = {t.name: t for t in tools}
        self.sandbox = sandbox
        self.label = f"session_{settings.session_version}"
        self._client = aio.run(_make_client(settings.concurrency))
        self._closers: list[Callable[[], None]] = []

    @classmethod
    def start(cls, context: RolloutContext) -> AgenticRollout:
        """Episodes against ``context.session_url`` when the orchestrator runs a session server;
        otherwise serve the engine over HTTP and a session server in front of it, both on loopback."""
        from contextlib import ExitStack

        config, aio, pm = context.config, context.aio, context.pm
        tools = context.task.tools
        stack = ExitStack()
        try:
            url = context.session_url or _serve_sessions(stack, context)
            sandbox = tool_sandbox(config, pm, aio, tools)
            if sandbox is not None:
                stack.callback(sandbox.close)
            rollout = cls(url, context.tokenizer, config.rollout, config.run.seed, aio, tools, sandbox)
        except BaseException:
            stack.close()
            raise
        rollout._closers.append(stack.close)
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

    async def _post(self, path: str, body: Any) -> Any:
        async with self._client.post(self.url + path, json=body) as response:
            if response.status >= 400:
                raise EpisodeError(
                    f"session server {path}: HTTP {response.status}: {(await response.text())[:300]}", response.status
                )
            return await response.json()

    async def _episode(self, prompt: Prompt, seed: int) -> Trajectory:
        s = self.settings
        session_id = (await self._post("/sessions", {}))["session_id"]
        try:
            messages = prompt.chat()
            turns, reply = 0, {}
            while turns < s.max_turns:
                body: dict[str, Any] = {
                    "messages": messages, "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                    "top_p": s.top_p, "top_k": s.top_k, "seed": (seed + turns) % 2**63,
                }
                if self.tools:
                    body["tools"] = [t.schema() for t in self.tools.values()]
                reply = (await self._chat(session_id, body))["choices"][0]
                turns += 1
                calls = reply["message"].get("tool_calls") or []
                if not calls or turns >= s.max_turns:
                    break
                messages = [*messages, reply["message"], *[await self._call_tool(c) for c in calls]]
            batch = await self._post(f"/sessions/{session_id}/samples", {})
        finally:
            async with self._client.delete(f"{self.url}/sessions/{session_id}") as response:
                if response.status not in (204, 404):
                    raise EpisodeError(f"session server DELETE /sessions/{session_id}: HTTP {response.status}")
        if len(batch["samples"]) != 1:
            raise EpisodeError(f"expected one sample per linear episode, got {len(batch['samples'])} ({batch.get('empty_reason')})")
        sample = batch["samples"][0]
        tokens, n = tuple(sample["tokens"]), sample["response_length"]
        return Trajectory(
            prompt=prompt,
            token_ids=tokens,
            response_length=n,
            loss_mask=tuple(sample["loss_mask"]),
            rollout_logprobs=tuple(sample["rollout_log_probs"]),
            completion=reply["message"].get("content") or "",
            first_token=self.tokenizer.decode(tokens[len(tokens) - n : len(tokens) - n + 1]),
            turns=turns,
            finish_reason=reply.get("finish_reason") or "",
            weight_version=",".join(sorted({str(v) for v in sample["weight_versions"]})),
        )

    async def _chat(self, session_id: str, body: dict[str, Any]) -> Any:
        failures = 0
        while True:
            try:
                return await self._post(f"/sessions/{session_id}/v1/chat/completions", body)
            except EpisodeError as exc:
                failures += 1
                if exc.status != 502 or failures > UPSTREAM_RETRIES:
                    raise

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
        self.aio.run(self._client.close())
        for close in reversed(self._closers):
            close()


def _serve_sessions(stack: ExitStack, context: RolloutContext) -> str:
    """The engine's HTTP app on loopback and a session server in front of it; the latter's URL."""
    from miles_core.engine.server import create_app
    from miles_core.session.config import SessionServerConfig
    from miles_core.session.embed import run_app_in_thread, serve_in_thread

    # served with the session server's long keep-alive: between steps the engine's connections
    # sit idle while the trainer works, longer than uvicorn's default 5 s
    engine_app = create_app(context.engine)
    engine_url = stack.enter_context(run_app_in_thread(engine_app))
    session_config = SessionServerConfig(
        upstream_url=engine_url, tokenizer_dir=str(context.model_dir), version=context.config.rollout.session_version,
    )
    # the session server calls the engine's app in-process (same requests, errors and timeouts as
    # over loopback HTTP, one hop less); engine_url still names it in errors
    return stack.enter_context(serve_in_thread(session_config, pm=context.pm, upstream_app=engine_app))


def tool_sandbox(config: TrainConfig, pm: MilesPluginManager, aio: BackgroundLoop,
                 tools: Sequence[SandboxTool]) -> WarmSandbox | None:
    """A warm sandbox with every tool's program installed (``None`` when there are no tools)."""
    if not tools:
        return None
    provider, options = tool_sandbox_settings(config.reward)
    sandbox = WarmSandbox(pm, provider, "tools", aio, config.reward.timeout_s, options)
    for tool in tools:
        aio.run(sandbox.install(f"tool_{tool.name}.py", tool.program))
    return sandbox


async def _make_client(concurrency: int) -> Any:
    """aiohttp: its connection pool stays cheap with many concurrent episodes (httpx's pool
    bookkeeping took a third of the rollout's CPU at 64 concurrent sessions)."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency),
        timeout=aiohttp.ClientTimeout(total=600.0, connect=10.0),
    )
