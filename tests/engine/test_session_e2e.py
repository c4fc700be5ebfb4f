"""End to end: an agent's multi-turn chat through the session server against the embedded engine.

The samples the session server assembles must carry, for every trained token, the log-prob that a
teacher-forced forward of the same model gives that token after the same prefix.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.engine import Engine, EngineConfig
from miles_core.engine.server import EmbeddedServer, create_app
from miles_core.plugins import MilesPluginManager
from miles_core.session import SessionServerConfig, serve_in_thread
from miles_core.testing.isolation import register_builtins

register_cpu_ci(est_time=13, suite="stage-a-cpu")


MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engine_server(tiny_dir):
    with EmbeddedServer(Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=8))) as server:
        server.start()
        yield server


def _turn(client: httpx.Client, session: str, messages: list[dict]) -> str:
    """One agent turn. The untrained tiny model rarely emits EOS and a session cannot continue a
    turn cut off at its token limit, so the agent retries with the next seed until one stops."""
    for seed in range(100):
        reply = client.post(
            f"/sessions/{session}/v1/chat/completions",
            json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed},
        )
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            return choice["message"]["content"]
    raise AssertionError("no seed in 0..99 ended the turn")


def _conversation(engine_server, tiny_dir, version: str, *, in_process: bool = False) -> list[dict]:
    """Three agent turns through a session server; its samples. ``in_process``: the session
    server calls the engine's ASGI app directly instead of its HTTP server."""
    pm = MilesPluginManager()
    register_builtins(pm)
    config = SessionServerConfig(upstream_url=engine_server.base_url, tokenizer_dir=tiny_dir, version=version)
    upstream_app = create_app(engine_server.engine) if in_process else None
    with serve_in_thread(config, pm=pm, upstream_app=upstream_app) as url, httpx.Client(base_url=url, timeout=120) as client:
        session = client.post("/sessions").json()["session_id"]
        messages = [{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": "1+2="}]
        for follow_up in ["and 3+4=?", "and 5+5=?", None]:
            messages.append({"role": "assistant", "content": _turn(client, session, messages)})
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        return client.post(f"/sessions/{session}/samples", json={}).json()["samples"]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_multi_turn_session_samples_match_a_teacher_forced_forward(engine_server, tiny_dir, reference_model, version) -> None:
    samples = _conversation(engine_server, tiny_dir, version)
    assert len(samples) == 1
    sample = samples[0]
    tokens, start = sample["tokens"], sample["prompt_length"]
    trained = [i for i, m in enumerate(sample["loss_mask"]) if m == 1]
    assert sample["response_length"] == len(tokens) - start == len(sample["loss_mask"])
    assert len(trained) >= 3 and sample["weight_versions"] == ["0", "0", "0"]
    with torch.no_grad():
        logprobs = reference_model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    expected = [float(logprobs[start + i - 1, tokens[start + i]]) for i in trained]
    got = [sample["rollout_log_probs"][i] for i in trained]
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 1e-5
    # observation tokens (the user turns in between) are not trained and carry no log-prob
    assert all(sample["rollout_log_probs"][i] == 0.0 for i, m in enumerate(sample["loss_mask"]) if m == 0)


def test_an_in_process_engine_gives_the_samples_http_gives(engine_server, tiny_dir) -> None:
    """Same seeds, same model: calling the engine's app in-process changes nothing but the transport."""
    over_http = _conversation(engine_server, tiny_dir, "v1")
    in_process = _conversation(engine_server, tiny_dir, "v1", in_process=True)
    assert in_process == over_http and sum(over_http[0]["loss_mask"]) >= 3
