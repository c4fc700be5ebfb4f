"""Fixtures for the session tests: the tiny tokenizer, a stub engine + session server per test,
and the scripted multi-turn scenarios the golden pins and the v1/v2 parity tests replay."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from miles_core.assets.tiny_tokenizer import tiny_tokenizer_dir
from miles_core.plugins import MilesPluginManager
from miles_core.session.config import SessionServerConfig
from miles_core.session.embed import serve_in_thread
from miles_core.session.tokenizer import ChatTokenizer
from miles_core.testing.engine_stub import Fault, ScriptedChat, StubEngine
from miles_core.testing.isolation import register_builtins

if TYPE_CHECKING:  # torch loads only in the modules whose tests use the engine fixtures
    from miles_core.engine.engine import Engine


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The tiny tokenizer, generated once per recipe into the miles cache (content-addressed)."""
    return tiny_tokenizer_dir()


@pytest.fixture(scope="session")
def chat_tokenizer(tokenizer_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The tiny preset (model and tokenizer), built once into the miles cache."""
    from miles_core.engine.presets import preset_dir

    return preset_dir("tiny")


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[Engine]:
    """The embedded engine over the tiny preset, one per test module."""
    import torch

    from miles_core.engine.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=16)) as e:
        yield e


@pytest.fixture(scope="module")
def preset_chat_tokenizer(tiny_dir: Path) -> ChatTokenizer:
    """The chat tokenizer of the tiny preset's own directory (the one its engine serves)."""
    return ChatTokenizer.from_dir(tiny_dir)


@dataclass
class Harness:
    """A stub engine and a session server in front of it, plus an HTTP client."""

    url: str
    stub: StubEngine
    client: httpx.Client
    version: str

    def create(self) -> str:
        response = self.client.post("/sessions")
        assert response.status_code == 200, response.text
        return response.json()["session_id"]

    def chat(self, session_id: str, body: dict[str, Any] | bytes) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.client.post(f"/sessions/{session_id}/v1/chat/completions", content=content)

    def state(self, session_id: str) -> httpx.Response:
        return self.client.get(f"/sessions/{session_id}")


@pytest.fixture(scope="session")
def _servers(tokenizer_dir: Path, chat_tokenizer: ChatTokenizer) -> Iterator[Callable[..., Harness]]:
    """Harnesses shared by the whole run, one per distinct configuration (starting a server
    costs ~0.3 s). Sessions are per test, and the stub keys its state by session."""
    cache: dict[str, Harness] = {}
    with ExitStack() as stack:

        def get(version: str = "v1", *, stub_delay: float = 0.0, **config: Any) -> Harness:
            key = json.dumps([version, stub_delay, config], sort_keys=True, default=str)
            if key not in cache:
                stub = stack.enter_context(StubEngine(ScriptedChat(chat_tokenizer), delay_s=stub_delay))
                pm = MilesPluginManager()
                register_builtins(pm)
                server_config = SessionServerConfig(
                    upstream_url=stub.url, tokenizer_dir=tokenizer_dir, version=version, **config
                )
                url = stack.enter_context(serve_in_thread(server_config, pm=pm, tokenizer=chat_tokenizer))
                client = stack.enter_context(httpx.Client(base_url=url, timeout=60))
                cache[key] = Harness(url, stub, client, version)
            return cache[key]

        yield get


@pytest.fixture
def serve(_servers: Callable[..., Harness]) -> Iterator[Callable[..., Harness]]:
    """``serve(version, stub_delay=0.0, **config)`` -> a running :class:`Harness`. A test must
    consume every fault it injects."""
    used: list[Harness] = []

    def get(*args: Any, **kwargs: Any) -> Harness:
        harness = _servers(*args, **kwargs)
        used.append(harness)
        return harness

    yield get
    for harness in used:
        assert harness.stub.pending_faults() == [], "the test left injected faults unconsumed"
        harness.stub.clear_faults()


# -- scripted scenarios ---------------------------------------------------------------------------


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


SYSTEM = {"role": "system", "content": "You are terse."}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "description": "Look a word up.", "parameters": {"type": "object"}},
    }
]


def message_from_sse(text: str) -> dict[str, Any]:
    """The assistant message carried by the session server's SSE reply."""
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text
    delta = dict(json.loads(events[0])["choices"][0]["delta"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in delta["tool_calls"]]
    return delta


@dataclass
class Recorder:
    """A scripted agent on one session: every exchange is recorded byte for byte, and every
    rejected request is checked to leave the session byte-identical."""

    harness: Harness
    session_id: str = ""
    steps: list[dict[str, Any]] = field(default_factory=list)
    _upstream_seen: int = 0

    def __post_init__(self) -> None:
        self.session_id = self.harness.create()

    def chat(self, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
        before = self.harness.state(self.session_id)
        body = {"messages": messages, **fields}
        response = self.harness.chat(self.session_id, body)
        upstream = self.harness.stub.chat_requests(self.session_id)
        sent = [r.body.decode() for r in upstream[self._upstream_seen :]]
        self._upstream_seen = len(upstream)
        self.steps.append({"op": "chat", "request": body, "status": response.status_code, "upstream": sent, "reply": response.text})
        after = self.harness.state(self.session_id)
        if response.status_code != 200:
            assert after.content == before.content, f"rejected request changed the session: {response.text}"
            assert set(json.loads(response.content)) == {"error"}
        else:
            assert len(after.json()["records"]) >= 1
        return response

    def turn(self, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        response = self.chat(messages, **fields)
        assert response.status_code == 200, response.text
        if fields.get("stream"):
            return message_from_sse(response.text)
        return response.json()["choices"][0]["message"]

    def samples(self, **body: Any) -> dict[str, Any]:
        response = self.harness.client.post(f"/sessions/{self.session_id}/samples", content=json.dumps(body))
        self.steps.append({"op": "samples", "request": body, "status": response.status_code, "reply": response.text})
        assert response.status_code == 200, response.text
        return response.json()

    def golden(self) -> dict[str, Any]:
        """Everything pinned: the exchanges and the final state (session id and clock removed)."""
        state = self.harness.state(self.session_id).json()
        sent = [json.loads(r.body) for r in self.harness.stub.chat_requests(self.session_id)]
        for record in state["records"]:  # each record holds exactly a body that went upstream
            assert record["request"] in sent
        text = json.dumps(
            {
                "version": self.harness.version,
                "steps": self.steps,
                "final": {
                    "records": [(r["seq"], r["parent"]) for r in state["records"]],
                    "accumulated_token_ids": state["metadata"]["accumulated_token_ids"],
                },
            },
            indent=1,
            ensure_ascii=False,
        )
        return json.loads(text.replace(self.session_id, "<session>"))


U1, U2, U3, U4 = user("What is 2+2?"), user("And 3+3?"), user("Now 4+4."), user("Last: 5+5.")


def pure_retry(r: Recorder) -> None:
    a1 = r.turn([U1])
    r.turn([U1, a1, U2])
    r.turn([U1, a1, U2])


def divergent_retry(r: Recorder) -> None:
    a1 = r.turn([U1])
    r.turn([U1, a1, U2])
    r.turn([U1, a1, user("And 9+9 instead?")])


def deep_rollback(r: Recorder) -> None:
    """v1 rejects discarding two generated turns (state unchanged); v2 branches instead."""
    a1 = r.turn([U1])
    a2 = r.turn([U1, a1, U2])
    a3 = r.turn([U1, a1, U2, a2, U3])
    r.chat([U1, a1, user("Forget that: 7+7?")])
    r.turn([U1, a1, U2, a2, U3, a3, U4])


def first_turn_retry(r: Recorder) -> None:
    r.turn([U1])
    r.turn([U1])


def failed_first_turn(r: Recorder) -> None:
    r.harness.stub.inject(Fault.STATUS_500)
    assert r.chat([U1]).status_code == 502
    a1 = r.turn([user("A different opening.")])
    r.turn([user("A different opening."), a1, U2])


def exact_resend(r: Recorder) -> None:
    """Re-sending the exact history (ending with the generated turn) asks for one more turn."""
    a1 = r.turn([U1])
    r.turn([U1, a1])


def disallowed_role(r: Recorder) -> None:
    a1 = r.turn([U1])
    a2 = r.turn([U1, a1, U2])
    assert r.chat([U1, a1, {"role": "developer", "content": "be brief"}]).status_code == 400
    r.turn([U1, a1, U2, a2, U3])


def few_shot_assistant(r: Recorder) -> None:
    """A client-carried assistant message is prompt, not a checkpoint to roll back to."""
    shots = [SYSTEM, user("1+1?"), {"role": "assistant", "content": "2"}]
    a1 = r.turn([*shots, U1])
    r.turn([*shots, U1, a1, U2])
    r.turn([*shots, U1, a1, user("And 6+6?")])


def tool_calls(r: Recorder) -> None:
    a1 = r.turn([SYSTEM, user("call apple")], tools=TOOLS)
    result = {"role": "tool", "content": "a fruit", "tool_call_id": a1["tool_calls"][0]["id"]}
    a2 = r.turn([SYSTEM, user("call apple"), a1, result], tools=TOOLS, stream=True)
    r.turn([SYSTEM, user("call apple"), a1, result, a2, user("call pear")], tools=TOOLS)


def truncated_turn(r: Recorder) -> None:
    a1 = r.turn([U1], max_tokens=5)
    assert r.chat([U1, a1, U2]).status_code == 409
    a1 = r.turn([U1])
    r.turn([U1, a1, U2])


SCENARIOS: dict[str, Callable[[Recorder], None]] = {
    fn.__name__: fn
    for fn in (
        pure_retry,
        divergent_retry,
        deep_rollback,
        first_turn_retry,
        failed_first_turn,
        exact_resend,
        disallowed_role,
        few_shot_assistant,
        tool_calls,
        truncated_turn,
    )
}


@pytest.fixture
def run_scenario(serve: Callable[..., Harness]) -> Callable[[str, str], dict[str, Any]]:
    """``run_scenario(name, version)`` -> the scenario's golden document (ends with samples)."""

    def run(name: str, version: str) -> dict[str, Any]:
        recorder = Recorder(serve(version))
        SCENARIOS[name](recorder)
        recorder.samples(metadata={"task": "pins"})
        return recorder.golden()

    return run


#: scenarios whose conversation is one linear path: v1 and v2 must agree exactly on them
LINEAR_SCENARIOS = tuple(name for name in SCENARIOS if name != "deep_rollback")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "scenario" in metafunc.fixturenames:
        metafunc.parametrize("scenario", list(SCENARIOS))
    if "linear_scenario" in metafunc.fixturenames:
        metafunc.parametrize("linear_scenario", LINEAR_SCENARIOS)
