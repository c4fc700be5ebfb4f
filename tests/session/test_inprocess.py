"""The session service in front of the embedded engine called in-process (EngineUpstream,
LocalSessions): the same turns, records and samples as over HTTP, and the engine's failures,
timeouts and cancellations as the HTTP path reports them, with the session unchanged."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-cpu")

pytest.importorskip("torch")
pytest.importorskip("miles_core.engine.server")

from miles_core.engine.client import EngineClient  # noqa: E402
from miles_core.session.errors import InvalidRequest, UpstreamFailure  # noqa: E402
from miles_core.session.service import SessionService  # noqa: E402
from miles_core.session.upstream import EngineUpstream, HTTPUpstream  # noqa: E402
from miles_core.session.versions import LinearVersion, TreeVersion  # noqa: E402

VERSIONS = {"v1": LinearVersion(), "v2": TreeVersion()}


@pytest.fixture(scope="module")
def tiny_dir():
    from miles_core.engine.presets import preset_dir

    return preset_dir("tiny")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    import torch

    from miles_core.engine.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=16)) as e:
        yield e


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_dir):
    from miles_core.session.tokenizer import ChatTokenizer

    return ChatTokenizer.from_dir(tiny_dir)


def _services(engine, chat_tokenizer, version):
    """The same service twice: the engine's HTTP app called in-process, and the engine itself."""
    from miles_core.engine.server import create_app

    over_http = HTTPUpstream(EngineClient("http://engine", app=create_app(engine)), vocab_size=chat_tokenizer.vocab_size)
    in_process = EngineUpstream(engine, vocab_size=chat_tokenizer.vocab_size)
    return (SessionService(VERSIONS[version], chat_tokenizer, over_http),
            SessionService(VERSIONS[version], chat_tokenizer, in_process))


def _conversation(service: SessionService, *, bytes_api: bool) -> tuple[str, list[dict]]:
    """Three turns; a turn cut off at its token limit cannot be continued, so it is retried with
    the next seed (stop strings end most turns early)."""

    async def run() -> tuple[str, list[dict]]:
        sid = service.create()
        messages = [{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": "1+2="}]
        replies, seed = [], 0
        for follow_up in ["and 3+4=?", "and 5+5=?", None]:
            while True:
                body = {"messages": messages, "max_tokens": 12, "seed": seed, "stop": [" ", "e", "a", "o", "\n"]}
                seed += 1
                outcome = await (service.chat(sid, json.dumps(body).encode()) if bytes_api else service.chat_object(sid, body))
                replies.append(outcome.reply)
                if not outcome.completion.truncated:
                    break
            messages = [*messages, outcome.reply["choices"][0]["message"]]
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        return sid, replies

    return asyncio.run(run())


def _without_ids(reply: dict) -> dict:
    reply = json.loads(json.dumps(reply))
    reply.pop("id"), reply.pop("created")
    for choice in reply["choices"]:
        choice["meta_info"].pop("id")
    return reply


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_in_process_engine_gives_what_http_gives(engine, chat_tokenizer, version) -> None:
    over_http, in_process = _services(engine, chat_tokenizer, version)
    sid_http, replies_http = _conversation(over_http, bytes_api=True)
    sid_local, replies_local = _conversation(in_process, bytes_api=False)
    assert [_without_ids(r) for r in replies_local] == [_without_ids(r) for r in replies_http]
    assert all(r["choices"][0]["logprobs"] is None for r in replies_local + replies_http)  # nobody asked
    samples_http, samples_local = over_http.samples(sid_http).samples, in_process.samples(sid_local).samples
    assert samples_local == samples_http and sum(samples_local[0].loss_mask) >= 3
    # records: what the engine was asked and answered, as JSON only when described
    http_records = over_http.describe(sid_http)["records"]
    local_records = in_process.describe(sid_local)["records"]
    assert [r["request"]["input_ids"] for r in local_records] == [r["request"]["input_ids"] for r in http_records]
    assert [_without_ids(r["response"])["choices"][0]["meta_info"] for r in local_records] == [
        _without_ids(r["response"])["choices"][0]["meta_info"] for r in http_records
    ]
    assert "logprobs" not in local_records[0]["request"]  # in-process, nothing is asked for that no one reads


def test_log_probs_only_when_the_caller_asks(engine, chat_tokenizer) -> None:
    for service in _services(engine, chat_tokenizer, "v1"):
        async def turn(service=service, **fields):
            sid = service.create()
            body = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 3, "seed": 1, **fields}
            return (await service.chat_object(sid, body)).reply["choices"][0]["logprobs"]

        assert asyncio.run(turn()) is None
        content = asyncio.run(turn(logprobs=True))["content"]
        assert len(content) == 3 and all(entry["logprob"] <= 0 for entry in content)


def test_a_refused_request_in_a_batch_fails_alone_and_records_nothing(engine, chat_tokenizer) -> None:
    _, service = _services(engine, chat_tokenizer, "v1")

    async def run():
        ok_sid, bad_sid = service.create(), service.create()
        ok = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 3, "seed": 1}
        too_long = {**ok, "max_tokens": engine.max_model_len}  # no room after the prompt: the engine refuses it
        results = await asyncio.gather(service.chat_object(ok_sid, ok), service.chat_object(bad_sid, too_long),
                                       return_exceptions=True)
        return ok_sid, bad_sid, results

    ok_sid, bad_sid, (good, bad) = asyncio.run(run())
    assert not isinstance(good, Exception) and len(good.completion.token_ids) == 3
    assert isinstance(bad, InvalidRequest) and "max_tokens" in bad.message and bad.status == 400
    assert service.describe(bad_sid)["records"] == [] and len(service.describe(ok_sid)["records"]) == 1


def test_engine_fields_are_validated_like_the_engine_http_front_does(engine, chat_tokenizer) -> None:
    _, service = _services(engine, chat_tokenizer, "v1")

    async def run():
        sid = service.create()
        with pytest.raises(InvalidRequest, match="frequency_penalty"):
            await service.chat_object(sid, {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5})
        with pytest.raises(InvalidRequest, match="seed"):
            await service.chat_object(sid, {"messages": [{"role": "user", "content": "x"}], "seed": -1})
        return sid

    sid = asyncio.run(run())
    assert service.describe(sid)["records"] == []


def test_timeouts_and_cancellations_abort_the_generation(engine, chat_tokenizer) -> None:
    upstream = EngineUpstream(engine, vocab_size=chat_tokenizer.vocab_size, timeout=0.05)
    service = SessionService(LinearVersion(), chat_tokenizer, upstream)
    long_turn = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2000, "ignore_eos": True, "seed": 3}

    async def run():
        sid = service.create()
        with pytest.raises(UpstreamFailure, match="EngineTimeoutError"):
            await service.chat_object(sid, long_turn)
        upstream.timeout = 600
        task = asyncio.ensure_future(service.chat_object(sid, long_turn))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the engine drops aborted requests before its next decode step
            if engine.stats()["running"] == 0:
                break
            await asyncio.sleep(0.01)
        return sid

    sid = asyncio.run(run())
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
    assert service.describe(sid)["records"] == []


def test_local_sessions_client(engine, tiny_dir) -> None:
    from miles_core.plugins import MilesPluginManager
    from miles_core.session.client import LocalSessions, SessionCallError
    from miles_core.testing.isolation import register_builtins

    pm = MilesPluginManager()
    register_builtins(pm)
    sessions = LocalSessions.for_engine(engine, tiny_dir, version="v1", pm=pm)

    async def run():
        sid = await sessions.create()
        turn = await sessions.chat(sid, {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 4, "seed": 5})
        [sample] = await sessions.samples(sid)
        with pytest.raises(SessionCallError) as info:
            await sessions.chat(sid, {"messages": []})
        await sessions.delete(sid)
        await sessions.delete(sid)  # already gone: fine, as over HTTP (404)
        with pytest.raises(SessionCallError) as missing:
            await sessions.samples(sid)
        await sessions.aclose()
        return turn, sample, info.value, missing.value

    turn, sample, invalid, missing = asyncio.run(run())
    assert turn.message["role"] == "assistant" and turn.finish_reason in ("stop", "length")
    assert sample.response_length == 4 and sample.loss_mask == [1, 1, 1, 1]
    assert all(lp < 0 for lp in sample.rollout_log_probs)
    assert invalid.status == 400 and missing.status == 404
