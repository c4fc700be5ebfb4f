"""The engine's HTTP contract: chat completions with meta_info, errors, weight updates, health."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.engine import Engine, EngineConfig
from miles_core.engine.protocol import parse_tool_calls
from miles_core.engine.server import EmbeddedServer

register_cpu_ci(est_time=11, suite="stage-a-cpu")

PROMPT = [257, 117, 115, 101, 114, 10, 104, 105, 258, 10, 257, 97, 115, 115, 105, 115, 116, 97, 110, 116, 10]


@contextmanager
def _serving(tiny_dir) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=8)), default_max_tokens=16) as s:
        s.start()
        yield s


def _client(server: EmbeddedServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60)


@pytest.fixture(scope="module")
def server(tiny_dir):
    """The module's server: its tests leave the engine's weights and version as loaded."""
    with _serving(tiny_dir) as s:
        yield s


@pytest.fixture
def client(server):
    with _client(server) as c:
        yield c


@pytest.fixture
def own_server_and_client(tiny_dir):
    """A server of its own and its client, for a test that replaces the weights: no other test may see them."""
    with _serving(tiny_dir) as s, _client(s) as c:
        yield s, c


def _chat(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_input_ids_completion_carries_meta_info_matching_a_teacher_forced_forward(client, teacher_forced) -> None:
    body = _chat(client, input_ids=PROMPT, max_tokens=12, temperature=0.8, top_k=50, seed=4, ignore_eos=True)
    choice = body["choices"][0]
    meta = choice["meta_info"]
    pairs = meta["output_token_logprobs"]
    assert meta["completion_tokens"] == len(pairs) == 12 == body["usage"]["completion_tokens"]
    assert all(isinstance(lp, float) and isinstance(tok, int) for lp, tok in pairs)
    assert meta["weight_version"] == body["weight_version"] == "0"
    assert meta["prompt_tokens"] == len(PROMPT)
    from miles_core.engine.base import SamplingParams

    tokens = [tok for _, tok in pairs]
    reference = teacher_forced(PROMPT, tokens, SamplingParams(temperature=0.8, top_k=50))
    assert max(abs(a - lp) for a, (lp, _) in zip(reference, pairs)) <= 1e-5
    assert choice["finish_reason"] == "length"


def test_messages_are_rendered_with_the_chat_template(client, server) -> None:
    messages = [{"role": "user", "content": "hi"}]
    rendered = server.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    by_messages = _chat(client, messages=messages, max_tokens=6, seed=1, return_prompt_token_ids=True)
    by_ids = _chat(client, messages=[{"role": "user", "content": "ignored: input_ids win"}], input_ids=rendered, max_tokens=6, seed=1)
    assert by_messages["choices"][0]["prompt_token_ids"] == rendered == PROMPT
    assert by_messages["choices"][0]["meta_info"]["output_token_logprobs"] == by_ids["choices"][0]["meta_info"]["output_token_logprobs"]
    assert by_messages["choices"][0]["meta_info"]["completion_tokens"] <= 6


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input_ids": [1, 2], "frobnicate": True}, "frobnicate"),
        ({"input_ids": [1, 2], "temperature": -0.5}, "temperature"),
        ({"input_ids": [1, 2], "top_p": 1.5}, "top_p"),
        ({"input_ids": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"input_ids": [1, 2], "n": 2}, "n"),
        ({"input_ids": [1, 2], "seed": "seven"}, "seed"),
        ({"input_ids": [1, 2], "stop_token_ids": [1.5]}, "stop_token_ids.0"),
        ({"input_ids": [1] * 2048}, "input_ids"),
        ({"input_ids": [1] * 2000, "max_tokens": 100}, "max_tokens"),
        ({"input_ids": [1, 10**6]}, "input_ids"),
        ({"input_ids": []}, "input_ids"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({}, "messages"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_changes_nothing(client, server, body: dict, field: str) -> None:
    before = server.engine.stats()
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field and error["message"].startswith(field)
    assert server.engine.stats() == before


def test_malformed_json_is_a_400(client) -> None:
    response = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"


def test_stream_answers_one_chunk_then_done(client) -> None:
    response = client.post("/v1/chat/completions", json={"input_ids": PROMPT, "max_tokens": 4, "stream": True, "seed": 2})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 2
    chunk = json.loads(events[0])
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"]["role"] == "assistant"
    assert len(chunk["choices"][0]["meta_info"]["output_token_logprobs"]) == chunk["choices"][0]["meta_info"]["completion_tokens"]


def test_health_and_info_routes(client) -> None:
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"]
    assert client.get("/get_weight_version").json()["weight_version"] == health["weight_version"]
    assert client.get("/v1/models").json()["data"][0]["id"] == health["model"]


def test_weight_update_from_disk_over_http(own_server_and_client, tmp_path) -> None:
    from safetensors.torch import save_file

    server, client = own_server_and_client
    generator = torch.Generator().manual_seed(0)
    weights = {n: (p.detach() + 0.05 * torch.randn(p.shape, generator=generator)).contiguous() for n, p in server.engine.model.named_parameters()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    request = {"input_ids": PROMPT, "max_tokens": 40, "seed": 9, "ignore_eos": True}
    version = server.engine.weight_version

    for bad, field in [({"model_path": str(tmp_path), "surprise": 1}, "surprise"), ({}, "model_path"),
                       ({"model_path": str(tmp_path / "nope")}, "model_path")]:
        response = client.post("/update_weights_from_disk", json=bad)
        assert response.status_code == 400
        assert response.json()["success"] is False and response.json()["error"]["param"] == field
    assert server.engine.weight_version == version

    before = _chat(client, **request)
    with ThreadPoolExecutor(4) as pool:  # in flight while the update arrives
        # long enough that none ends before the last is admitted, on a loaded 2-core machine too
        in_flight = [pool.submit(_chat, client, **{**request, "seed": i, "max_tokens": 400}) for i in range(4)]
        deadline = time.monotonic() + 60
        while server.engine.stats()["running"] < 4:
            assert not any(f.done() for f in in_flight), "a request ended before all four were in flight"
            assert time.monotonic() < deadline, f"four requests never ran together: {server.engine.stats()}"
            threading.Event().wait(0.001)
        update = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "step-7"})
        finished = [f.result() for f in in_flight]
    assert update.status_code == 200 and update.json()["success"] is True
    assert {f["choices"][0]["meta_info"]["weight_version"] for f in finished} == {version}
    after = _chat(client, **request)
    assert after["weight_version"] == after["choices"][0]["meta_info"]["weight_version"] == "step-7"
    assert after["choices"][0]["meta_info"]["output_token_logprobs"] != before["choices"][0]["meta_info"]["output_token_logprobs"]
    assert client.get("/get_weight_version").json()["weight_version"] == "step-7"


def test_tool_calls_are_parsed_out_of_the_text() -> None:
    text = 'Let me check.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])


def test_health_is_503_when_the_engine_cannot_serve(tiny_dir) -> None:
    from starlette.testclient import TestClient

    from miles_core.engine.server import create_app

    closed = Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=1))
    closed.close()
    response = TestClient(create_app(closed)).get("/health")
    assert response.status_code == 503
    assert response.json()["error"] == {"type": "engine_unavailable", "message": "the engine is closed"}


def test_a_client_that_disconnects_stops_its_generation(client, server) -> None:
    # 1900 tokens take the tiny engine >= ~1 s even on a fast, idle machine (>= 0.5 ms a step for one
    # row); the client leaves after 0.1 s and the server looks every DISCONNECT_POLL_S, so an aborted
    # generation stops well short of it, and one that is not aborted runs to the end
    long = {"input_ids": PROMPT, "max_tokens": 1900, "ignore_eos": True, "seed": 0}
    before = server.engine.stats()["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=long, timeout=0.1)
    pause = threading.Event()
    for _ in range(100):
        if server.engine.stats()["running"] == 0:
            break
        pause.wait(0.05)
    stats = server.engine.stats()
    assert stats["running"] == 0
    assert stats["generated_tokens"] - before < long["max_tokens"]
