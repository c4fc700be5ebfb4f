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


def _services(engine, preset_chat_tokenizer, version):
    """The same service twice: the engine's HTTP app called in-process, and the engine itself."""
    from miles_core.engine.server import create_app

    over_http = HTTPUpstream(EngineClient("http://engine", app=create_app(engine)), vocab_size=preset_chat_tokenizer.vocab_size)
    in_process = EngineUpstream(engine, vocab_size=preset_chat_tokenizer.vocab_size)
    return (SessionService(VERSIONS[version], preset_chat_tokenizer, over_http),
            SessionService(VERSIONS[version], preset_chat_tokenizer, in_process))


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
def test_in_process_engine_gives_what_http_gives(engine, preset_chat_tokenizer, version) -> None:
    over_http, in_process = _services(engine, preset_chat_tokenizer, version)
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


def test_log_probs_only_when_the_caller_asks(engine, preset_chat_tokenizer) -> None:
    for service in _services(engine, preset_chat_tokenizer, "v1"):
        async def turn(service=service, **fields):
            sid = service.create()
            body = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 3, "seed": 1, **fields}
            return (await service.chat_object(sid, body)).reply["choices"][0]["logprobs"]

        assert asyncio.run(turn()) is None
        content = asyncio.run(turn(logprobs=True))["content"]
        assert len(content) == 3 and all(entry["logprob"] <= 0 for entry in content)


def test_a_refused_request_in_a_batch_fails_alone_and_records_nothing(engine, preset_chat_tokenizer) -> None:
    _, service = _services(engine, preset_chat_tokenizer, "v1")

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


def test_engine_fields_are_validated_like_the_engine_http_front_does(engine, preset_chat_tokenizer) -> None:
    _, service = _services(engine, preset_chat_tokenizer, "v1")

    async def run():
        sid = service.create()
        with pytest.raises(InvalidRequest, match="frequency_penalty"):
            await service.chat_object(sid, {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5})
        with pytest.raises(InvalidRequest, match="seed"):
            await service.chat_object(sid, {"messages": [{"role": "user", "content": "x"}], "seed": -1})
        return sid

    sid = asyncio.run(run())
    assert service.describe(sid)["records"] == []



async def _until_nothing_runs(engine) -> None:
    """Up to 2 s: the engine drops aborted requests before its next decode step."""
    for _ in range(200):
        if engine.stats()["running"] == 0:
            return
        await asyncio.sleep(0.01)

def test_timeouts_and_cancellations_abort_the_generation(engine, preset_chat_tokenizer) -> None:
    upstream = EngineUpstream(engine, vocab_size=preset_chat_tokenizer.vocab_size, timeout=0.05)
    service = SessionService(LinearVersion(), preset_chat_tokenizer, upstream)
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
        await _until_nothing_runs(engine)
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


def _group_bodies(groups: int = 3, size: int = 4) -> list[dict]:
    """GRPO-like first turns: each group's bodies share one messages object and vary the seed."""
    bodies = []
    for g in range(groups):
        messages = [{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": f"{g}+2="}]
        bodies += [{"messages": messages, "max_tokens": 12, "seed": 10 * g + i, "stop": [" ", "e", "a", "o", "\n"]}
                   for i in range(size)]
    return bodies


def _follow_up(body: dict, outcome) -> dict:
    message = outcome.reply["choices"][0]["message"]
    return {**body, "messages": [*body["messages"], message, {"role": "user", "content": "and 1+1=?"}], "seed": body["seed"] + 1}


def _assert_same_turn(a, b) -> None:
    x, y = a.completion, b.completion
    assert (x.message, x.token_ids, x.finish_reason, x.weight_version) == (y.message, y.token_ids, y.finish_reason, y.weight_version)
    assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)), default=0.0) <= 1e-5
    assert _without_ids(a.reply)["choices"][0]["message"] == _without_ids(b.reply)["choices"][0]["message"]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_batch_calls_give_what_one_call_per_session_gives(engine, preset_chat_tokenizer, version) -> None:
    """create_many / chat_many / samples_many / delete_many against create / chat_object /
    samples / delete, two turns deep: the same turns, replies, records and samples."""
    one = SessionService(VERSIONS[version], preset_chat_tokenizer, EngineUpstream(engine, vocab_size=preset_chat_tokenizer.vocab_size))
    many = SessionService(VERSIONS[version], preset_chat_tokenizer, EngineUpstream(engine, vocab_size=preset_chat_tokenizer.vocab_size))
    first = _group_bodies()

    async def per_session():
        sids = [one.create() for _ in first]
        outcomes = [await one.chat_object(sid, body) for sid, body in zip(sids, first)]
        going = [i for i, o in enumerate(outcomes) if not o.completion.truncated]
        again = [await one.chat_object(sids[i], _follow_up(first[i], outcomes[i])) for i in going]
        samples = [one.samples(sid) for sid in sids]
        records = [one.describe(sid) for sid in sids]
        for sid in sids:
            await one.delete(sid)
        return outcomes, going, again, samples, records

    async def batched():
        sids = many.create_many(len(first))
        outcomes = await many.chat_many(list(zip(sids, first)))
        going = [i for i, o in enumerate(outcomes) if not o.completion.truncated]
        again = await many.chat_many([(sids[i], _follow_up(first[i], outcomes[i])) for i in going])
        samples = many.samples_many(sids)
        records = [many.describe(sid) for sid in sids]
        await many.delete_many(sids)
        return outcomes, going, again, samples, records

    (o1, g1, a1, s1, r1), (o2, g2, a2, s2, r2) = asyncio.run(per_session()), asyncio.run(batched())
    assert g1 == g2 and len(g1) >= 2, "too few first turns can be continued; pick other seeds"
    for a, b in zip([*o1, *a1], [*o2, *a2], strict=True):
        _assert_same_turn(a, b)
    for x, y in zip(s1, s2, strict=True):
        assert x.empty_reason == y.empty_reason
        for p, q in zip(x.samples, y.samples, strict=True):
            assert (p.tokens, p.loss_mask, p.status, p.metadata, p.weight_versions) == (
                q.tokens, q.loss_mask, q.status, q.metadata, q.weight_versions)
            assert max(abs(u - v) for u, v in zip(p.rollout_log_probs, q.rollout_log_probs, strict=True)) <= 1e-5
    for x, y in zip(r1, r2, strict=True):
        assert [r["request"] for r in x["records"]] == [r["request"] for r in y["records"]]
        assert [_without_ids(r["response"])["choices"][0]["message"] for r in x["records"]] == [
            _without_ids(r["response"])["choices"][0]["message"] for r in y["records"]]
        assert x["metadata"]["accumulated_token_ids"] == y["metadata"]["accumulated_token_ids"]
    assert one.health()["sessions"] == many.health()["sessions"] == 0


def test_a_failing_turn_in_a_batch_fails_alone_and_leaves_its_session_unchanged(engine, preset_chat_tokenizer) -> None:
    from miles_core.session.errors import Conflict, SessionNotFound

    service = SessionService(LinearVersion(), preset_chat_tokenizer, EngineUpstream(engine, vocab_size=preset_chat_tokenizer.vocab_size))
    ok = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 3, "seed": 1}
    cases = {
        "engine field": {**ok, "frequency_penalty": 0.5},  # refused by the engine's request validation
        "bad role": {**ok, "messages": [{"role": "robot", "content": "x"}]},  # refused by the normalizer
        "no room": {**ok, "max_tokens": engine.max_model_len},  # refused by the engine at submission
    }

    async def run():
        sids = service.create_many(2 + len(cases))
        turns = [(sids[0], ok), (sids[0], {**ok, "seed": 2}), (sids[1], {**ok, "seed": 3}), ("nobody", ok)]
        turns += [(sid, body) for sid, body in zip(sids[2:], cases.values())]
        return sids, await service.chat_many(turns)

    sids, results = asyncio.run(run())
    first, second, third, missing, *refused = results
    assert len(first.completion.token_ids) == 3 and len(third.completion.token_ids) == 3
    assert isinstance(second, Conflict) and second.status == 409  # v1: one generation in flight per session
    assert isinstance(missing, SessionNotFound) and missing.status == 404
    assert [type(e).__name__ for e in refused] == ["InvalidRequest"] * 3 and all(e.status == 400 for e in refused)
    assert "frequency_penalty" in refused[0].message and "max_tokens" in refused[2].message
    assert [len(service.describe(sid)["records"]) for sid in sids] == [1, 1, 0, 0, 0]
    assert all(service.get(sid).in_flight == 0 for sid in sids)


def test_create_samples_and_delete_many_refuse_before_changing_anything(preset_chat_tokenizer) -> None:
    from miles_core.session.config import ServiceLimits
    from miles_core.session.errors import Conflict, SessionNotFound

    service = SessionService(LinearVersion(), preset_chat_tokenizer, upstream=None, limits=ServiceLimits(max_sessions=3))  # type: ignore[arg-type]
    sids = service.create_many(2)
    with pytest.raises(Conflict, match="cannot open 2 more"):
        service.create_many(2)
    assert service.health()["sessions"] == 2
    with pytest.raises(SessionNotFound):
        service.samples_many([sids[0], "nobody"])
    assert [b.empty_reason for b in service.samples_many(sids)] == ["no_records", "no_records"]
    with pytest.raises(SessionNotFound):
        asyncio.run(service.delete_many([sids[0], "nobody"]))
    assert service.health()["sessions"] == 2 and not service.get(sids[0]).closing
    asyncio.run(service.delete_many([sids[0], "nobody"], missing_ok=True))
    assert service.health()["sessions"] == 1
    assert len({*sids, *service.create_many(2)}) == 4  # fresh ids


def test_a_batch_that_times_out_or_is_cancelled_is_aborted_in_the_engine(engine, preset_chat_tokenizer) -> None:
    upstream = EngineUpstream(engine, vocab_size=preset_chat_tokenizer.vocab_size, timeout=0.05)
    service = SessionService(TreeVersion(), preset_chat_tokenizer, upstream)
    long_turn = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2000, "ignore_eos": True, "seed": 3}

    async def run():
        sids = service.create_many(3)
        timed_out = await service.chat_many([(sid, long_turn) for sid in sids])
        upstream.timeout = 600
        task = asyncio.ensure_future(service.chat_many([(sid, long_turn) for sid in sids]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until_nothing_runs(engine)
        return sids, timed_out

    sids, timed_out = asyncio.run(run())
    assert all(isinstance(e, UpstreamFailure) and "EngineTimeoutError" in e.message for e in timed_out)
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
    assert all(service.describe(sid)["records"] == [] and service.get(sid).in_flight == 0 for sid in sids)


def test_local_sessions_batch_calls(engine, tiny_dir) -> None:
    from miles_core.plugins import MilesPluginManager
    from miles_core.session.client import ChatTurn, LocalSessions, SessionCallError
    from miles_core.testing.isolation import register_builtins

    pm = MilesPluginManager()
    register_builtins(pm)
    sessions = LocalSessions.for_engine(engine, tiny_dir, version="v1", pm=pm)
    body = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 4}

    async def run():
        sids = await sessions.create_many(2)
        turns = await sessions.chat_many([(sids[0], {**body, "seed": 5}), (sids[1], {"messages": []})])
        samples = await sessions.samples_many(sids)
        alone = await sessions.create()
        await sessions.chat(alone, {**body, "seed": 5})
        [sample] = await sessions.samples(alone)
        await sessions.delete_many([*sids, alone])
        await sessions.delete_many(sids)  # already gone: fine, as over HTTP (404)
        with pytest.raises(SessionCallError) as missing:
            await sessions.samples_many(sids)
        return turns, samples, sample, missing.value

    (turn, invalid), (first, empty), alone, missing = asyncio.run(run())
    assert isinstance(turn, ChatTurn) and turn.message["role"] == "assistant"
    assert isinstance(invalid, SessionCallError) and invalid.status == 400
    assert first[0].tokens == alone.tokens and first[0].loss_mask == alone.loss_mask == [1, 1, 1, 1] and empty == []
    assert missing.status == 404
