"""Upstream faults: every one answers 502 JSON with a bounded message, records nothing, leaves the
session byte-identical, and the session keeps working afterwards."""

import json
import socket

import httpx
import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.session.config import SessionServerConfig
from miles_core.session.embed import serve_in_thread
from miles_core.testing.engine_stub import Fault

register_cpu_ci(est_time=10, suite="stage-a-cpu")

Q1 = {"role": "user", "content": "first question"}
Q2 = {"role": "user", "content": "second question"}

EXPECTED = {
    Fault.TIMEOUT: "EngineTimeoutError",
    Fault.RESET: "EngineConnectionError",
    Fault.STATUS_500: "engine answered HTTP 500",
    Fault.INVALID_JSON: "not valid JSON",
    Fault.MISSING_META_INFO: "meta_info is missing",
    Fault.LOGPROB_COUNT_MISMATCH: "completion_tokens=",
}


@pytest.mark.parametrize("fault", list(Fault), ids=lambda f: f.value)
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_fault_answers_502_and_changes_nothing(serve, version, fault) -> None:
    harness = serve(version, upstream_timeout=0.5)
    sid = harness.create()
    first = harness.chat(sid, {"messages": [Q1]})
    assert first.status_code == 200
    history = [Q1, first.json()["choices"][0]["message"], Q2]
    before = harness.state(sid).content
    # a lone reset on a reused connection is the keep-alive race, retried once on a new
    # connection (test_a_lone_reset_is_retried_once): an engine that resets again answers 502
    harness.stub.inject(*[fault] * (2 if fault is Fault.RESET else 1))
    response = harness.chat(sid, {"messages": history})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "upstream_error"
    assert EXPECTED[fault] in error["message"], error["message"]
    assert len(response.content) < 2048 and "Traceback" not in response.text
    assert harness.state(sid).content == before
    retry = harness.chat(sid, {"messages": history})
    assert retry.status_code == 200
    assert len(harness.state(sid).json()["records"]) == 2


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_lone_reset_is_retried_once(serve, version) -> None:
    """A reused connection that ends before a byte of reply: sent again on a new connection, and
    the turn is recorded once."""
    harness = serve(version)
    sid = harness.create()
    first = harness.chat(sid, {"messages": [Q1]})
    assert first.status_code == 200
    harness.stub.inject(Fault.RESET)
    second = harness.chat(sid, {"messages": [Q1, first.json()["choices"][0]["message"], Q2]})
    assert second.status_code == 200, second.text
    sent = harness.stub.chat_requests(sid)
    assert len(sent) == 3 and sent[1].body == sent[2].body  # the lost request, then its retry
    assert len(harness.state(sid).json()["records"]) == 2


def test_failed_first_turn_records_nothing(serve) -> None:
    harness = serve("v1")
    sid = harness.create()
    harness.stub.inject(Fault.STATUS_500)
    assert harness.chat(sid, {"messages": [Q1]}).status_code == 502
    state = harness.state(sid).json()
    assert state["records"] == [] and state["metadata"]["accumulated_token_ids"] == []
    samples = harness.client.post(f"/sessions/{sid}/samples").json()
    assert samples["samples"] == [] and samples["empty_reason"] == "no_records"


def test_engine_rejection_is_the_clients_error(serve) -> None:
    harness = serve("v1")
    sid = harness.create()
    response = harness.chat(sid, {"messages": [Q1], "max_tokens": -1})
    assert response.status_code == 400
    assert "max_tokens must be a non-negative integer" in response.json()["error"]["message"]
    assert harness.state(sid).json()["records"] == []


def test_engine_down_answers_502_after_connect_retries(tokenizer_dir, chat_tokenizer) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = SessionServerConfig(
        upstream_url=f"http://127.0.0.1:{port}", tokenizer_dir=tokenizer_dir, connect_retries=2
    )
    with serve_in_thread(config, tokenizer=chat_tokenizer) as url, httpx.Client(base_url=url) as client:
        sid = client.post("/sessions").json()["session_id"]
        response = client.post(f"/sessions/{sid}/v1/chat/completions", content=json.dumps({"messages": [Q1]}))
        assert response.status_code == 502
        assert "after 3 attempt(s)" in response.json()["error"]["message"]
        assert client.get(f"/sessions/{sid}").json()["records"] == []


class _OutOfVocabulary:
    """The stub's responder, with one token id of the next reply replaced by ``bad``."""

    def __init__(self, inner, bad: int) -> None:
        self.inner, self.bad = inner, bad

    def __call__(self, request):
        reply = self.inner(request)
        reply["choices"][0]["meta_info"]["output_token_logprobs"][1][1] = self.bad
        return reply


@pytest.mark.parametrize("bad", [2**70, 10**9, 265], ids=["2**70", "1e9", "vocab_size"])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_token_ids_outside_the_vocabulary_answer_502_and_change_nothing(serve, version, bad) -> None:
    harness = serve(version)  # the tiny tokenizer: 265 ids
    sid = harness.create()
    first = harness.chat(sid, {"messages": [Q1]})
    history = [Q1, first.json()["choices"][0]["message"], Q2]
    before = harness.state(sid).content
    samples_before = harness.client.post(f"/sessions/{sid}/samples").content
    inner = harness.stub.responder
    harness.stub.responder = _OutOfVocabulary(inner, bad)
    try:
        response = harness.chat(sid, {"messages": history})
    finally:
        harness.stub.responder = inner
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "upstream_error"
    assert f"token id {bad} is outside the tokenizer's vocabulary (265 ids: 0..264)" in error["message"]
    assert harness.state(sid).content == before
    assert harness.client.post(f"/sessions/{sid}/samples").content == samples_before
    assert harness.chat(sid, {"messages": history}).status_code == 200
    sent = json.loads(harness.stub.chat_requests(sid)[-1].body)["input_ids"]
    assert max(sent) < 265


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_an_empty_completion_at_its_token_limit_is_a_truncated_turn(serve, version) -> None:
    harness = serve(version)
    sid = harness.create()
    reply = harness.chat(sid, {"messages": [Q1], "max_tokens": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    [record] = harness.state(sid).json()["records"]
    [sample] = harness.client.post(f"/sessions/{sid}/samples").json()["samples"]
    assert sample["response_length"] == 0 and sample["loss_mask"] == [] and sample["tokens"] == record["request"]["input_ids"]
    extended = harness.chat(sid, {"messages": [Q1, reply.json()["choices"][0]["message"], Q2]})
    assert extended.status_code == 409  # like every turn its token limit cut off
