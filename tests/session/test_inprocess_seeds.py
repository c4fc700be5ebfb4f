"""A batch of turns sent as one body object per group with a seed per turn (``seeds=``) records
exactly what the same turns sent as one body each, holding those seeds, record; and the shortcuts
the in-process batch takes (a known conversation's bare body, a repeated body object) give what
the full validation gives."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=6, suite="stage-a-cpu")

pytest.importorskip("torch")

from miles_core.session.errors import InvalidRequest  # noqa: E402
from miles_core.session.normalize import (  # noqa: E402
    OWN,
    normalize_chat_batch,
    normalize_chat_object,
    normalize_chat_objects,
)
from miles_core.session.service import SessionService  # noqa: E402
from miles_core.session.upstream import EngineUpstream  # noqa: E402
from miles_core.session.versions import LinearVersion, TreeVersion  # noqa: E402

VERSIONS = {"v1": LinearVersion(), "v2": TreeVersion()}
STOP = [" ", "e", "a", "o", "\n"]


def _groups(groups: int = 3, size: int = 4) -> list[tuple[dict, list[int]]]:
    """One body per group (no seed of its own) and the seeds of its turns."""
    out = []
    for g in range(groups):
        messages = [{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": f"{g}+2="}]
        out.append(({"messages": messages, "max_tokens": 12, "stop": STOP}, [10 * g + i for i in range(size)]))
    return out


def _records(service: SessionService, sid: str) -> list[dict]:
    described = service.describe(sid)
    out = []
    for record in described["records"]:
        response = json.loads(json.dumps(record["response"]))
        response.pop("id"), response.pop("created")
        response["choices"][0]["meta_info"].pop("id")
        out.append({"request": record["request"], "response": response})
    return out


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_one_body_with_seeds_records_what_bodies_holding_the_seeds_record(engine, preset_chat_tokenizer, version) -> None:
    """Two turns deep: first turns sent as three group bodies with twelve seeds (chat_turns and
    chat_many), and as twelve bodies each holding its seed; then follow-ups, each its own body,
    seeded the same two ways. The same completions, records (what the engine was asked and
    answered) and samples."""
    groups = _groups()

    def service() -> SessionService:
        return SessionService(VERSIONS[version], preset_chat_tokenizer, EngineUpstream(engine, vocab_size=preset_chat_tokenizer.vocab_size))

    async def run(how: str):
        s = service()
        sids = s.create_many(sum(len(seeds) for _, seeds in groups))
        if how == "bodies":
            turns = [(sid, {**body, "seed": seed}) for sid, (body, seed) in
                     zip(sids, [(body, seed) for body, seeds in groups for seed in seeds])]
            first = await s.chat_many(turns)
        else:
            turns = [(sid, body) for sid, body in zip(sids, [body for body, seeds in groups for _ in seeds])]
            seeds = [seed for _, group_seeds in groups for seed in group_seeds]
            first = await (s.chat_turns(turns, seeds=seeds) if how == "turns" else s.chat_many(turns, seeds=seeds))
        assert not any(isinstance(r, Exception) for r in first), first
        messages = [r.message if how == "turns" else r.completion.message for r in first]
        finished = [r.finish_reason if how == "turns" else r.completion.finish_reason for r in first]
        going = [i for i, reason in enumerate(finished) if reason != "length"]
        follow = [(sids[i], {**turns[i][1], "messages": [*turns[i][1]["messages"], messages[i],
                                                         {"role": "user", "content": "and 1+1=?"}]}) for i in going]
        if how == "bodies":
            second = await s.chat_many([(sid, {**body, "seed": body["seed"] + 1}) for sid, body in follow])
        else:
            follow_seeds = [seeds[i] + 1 for i in going]
            second = await (s.chat_turns(follow, seeds=follow_seeds) if how == "turns"
                            else s.chat_many(follow, seeds=follow_seeds))
        second_messages = [r.message if how == "turns" else r.completion.message for r in second]
        return (messages, finished, going, second_messages, [_records(s, sid) for sid in sids],
                [[sample.to_dict() for sample in s.samples(sid).samples] for sid in sids])

    bodies, turns, outcomes = asyncio.run(run("bodies")), asyncio.run(run("turns")), asyncio.run(run("outcomes"))
    assert len(bodies[2]) >= 2, "too few first turns can be continued; pick other seeds"
    assert len({json.dumps(m) for m in bodies[0]}) > 1  # the seeds sampled different turns
    for other in (turns, outcomes):  # the same batches reach the engine: the same bits come back
        assert other[:4] == bodies[:4]
        assert other[4] == bodies[4]  # the same request (the seed in its place) and reply, turn for turn
        assert other[5] == bodies[5]


def test_seeds_normalize_as_the_bodies_holding_them() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    shared = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "tools": tools}
    streamed = {**shared, "stream": True, "seed": 4}  # a seed of its own, replaced
    copy = {**shared}
    raws = [shared, shared, shared, copy, copy, shared, streamed, streamed, {"messages": [{"role": "robot"}]}, shared]
    seeds = [1, 2, None, 3, 4, 9, 5, 6, 7, 8]
    batch = normalize_chat_objects(raws, [None] * len(raws), seeds)
    merged = normalize_chat_objects([{**raw, "seed": seed} for raw, seed in zip(raws, seeds)], [None] * len(raws))
    for got, want, raw, seed in zip(batch, merged, raws, seeds, strict=True):
        alone: object
        try:
            alone = normalize_chat_object({**raw, "seed": seed})
        except InvalidRequest as exc:
            alone = exc.message
        if isinstance(got, InvalidRequest):
            assert isinstance(want, InvalidRequest) and got.message == want.message == alone
            continue
        assert got == want == alone and got.forward == want.forward == alone.forward  # type: ignore[union-attr]
        assert list(got.forward) == list(alone.forward)  # the seed in its place  # type: ignore[union-attr]
    assert [getattr(r, "variant_of", None) is batch[0] for r in batch[:6]] == [False, True, True, True, True, True]
    assert batch[7].variant_of is batch[6] and batch[9].variant_of is None  # type: ignore[union-attr]
    assert len({id(r) for r in batch}) == len(batch)  # every body its own request
    requests, sent = normalize_chat_batch(raws, [None] * len(raws), seeds)  # the shared form the service sends
    assert [r is requests[i - 1] for i, r in enumerate(requests)][1:] == [True, True, False, True, False, False, True,
                                                                          False, False]
    assert sent == [OWN, 2, None, OWN, 4, OWN, OWN, 6, OWN, OWN]
    with pytest.raises(ValueError, match="2 seeds for 3 bodies"):
        normalize_chat_objects([shared] * 3, [None] * 3, [1, 2])


def test_a_known_conversation_with_a_bare_body_is_refused_and_accepted_as_an_unknown_one() -> None:
    """The first-turn cache validates only the messages of a body that sets no field the schema
    declares: keys that are not strings, and declared fields, still get the full validation."""
    messages = [{"role": "user", "content": "known"}]
    normalize_chat_object({"messages": json.loads(json.dumps(messages))})  # now known
    bodies = [
        {"messages": messages, "max_tokens": 2, "anything": {"goes": [1, None]}},
        {"messages": messages, 3: "a key that is not a string"},
        {"messages": messages, "stream": "yes"},
        {"messages": messages, "n": 1, "tools": None},
    ]
    for body in bodies:
        try:
            known: object = normalize_chat_object(body)
        except InvalidRequest as exc:
            known = exc.message
        from miles_core.session import normalize

        entries = normalize._CONVERSATIONS._entries
        saved = dict(entries)
        entries.clear()  # the same body, its conversation unknown
        try:
            try:
                unknown: object = normalize_chat_object(body)
            except InvalidRequest as exc:
                unknown = exc.message
        finally:
            entries.clear()
            entries.update(saved)
        assert known == unknown
        if not isinstance(known, str):
            assert known.forward == unknown.forward  # type: ignore[attr-defined]


def test_seeds_reach_an_engine_over_http_as_the_bodies_holding_them(engine, preset_chat_tokenizer) -> None:
    """A service whose upstream is an engine over HTTP sends each seeded turn's body with its
    seed in place: the requests recorded (the exact bytes sent) are those of the bodies holding
    the seeds, and the same tokens come back."""
    pytest.importorskip("miles_core.engine.server")
    from miles_core.engine.client import EngineClient
    from miles_core.engine.server import create_app
    from miles_core.session.upstream import HTTPUpstream

    body = {"messages": [{"role": "user", "content": "3+4="}], "max_tokens": 6, "seed": None, "stop": STOP}
    seeds = [3, 4, 5, 6]

    async def run(seeded: bool):
        upstream = HTTPUpstream(EngineClient("http://engine", app=create_app(engine)), vocab_size=preset_chat_tokenizer.vocab_size)
        service = SessionService(LinearVersion(), preset_chat_tokenizer, upstream)
        sids = service.create_many(len(seeds))
        if seeded:
            results = await service.chat_many([(sid, body) for sid in sids], seeds=seeds)
        else:
            results = await service.chat_many([(sid, {**body, "seed": seed}) for sid, seed in zip(sids, seeds)])
        records = [service.describe(sid)["records"][0] for sid in sids]
        await upstream.aclose()
        return [r.completion.token_ids for r in results], [r["request"] for r in records]

    (tokens_seeded, sent_seeded), (tokens, sent) = asyncio.run(run(True)), asyncio.run(run(False))
    assert tokens_seeded == tokens and len(set(tokens)) > 1
    assert sent_seeded == sent and [list(r) for r in sent_seeded] == [list(r) for r in sent]  # the seed in its place
    assert [r["seed"] for r in sent_seeded] == seeds
