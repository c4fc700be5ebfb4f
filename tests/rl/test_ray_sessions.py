"""RaySessions (a Ray rollout worker's session client) against the engine actor's
``sessions_call``, with the actor handle played in this process: every argument and result is
pickled both ways, as Ray does, so what a worker gets back -- turns, samples, and a session
call's failure with its HTTP status -- is what crosses the process boundary."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=8, suite="stage-b-cpu")

pytest.importorskip("miles_core.engine.engine", reason="the embedded engine (engine concern) is not installed")

from miles_core.rl.orchestrators.ray import EngineWorker, RaySessions  # noqa: E402
from miles_core.session.client import ChatTurn, SessionCallError  # noqa: E402


class _Remote:
    """``handle.method.remote(...)`` of a Ray actor, run here; its ObjectRef's ``future()``."""

    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any) -> SimpleNamespace:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(pickle.loads(pickle.dumps(self.method(*pickle.loads(pickle.dumps(args))))))
        except Exception as exc:  # what the actor raised, as the ObjectRef would carry it
            future.set_exception(exc)
        return SimpleNamespace(future=lambda: future)


@pytest.fixture(scope="module")
def worker():
    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.config import load_config
    from miles_core.rl.runtime import model_directory

    config = load_config("tiny")
    engine_worker = EngineWorker(config, str(model_directory(config)), get_plugin_manager().fingerprint(), num_prompts=4)
    yield engine_worker
    engine_worker.close()


def test_a_phase_of_turns_comes_back_as_in_process(worker):
    sessions = RaySessions(SimpleNamespace(sessions_call=_Remote(worker.sessions_call)))
    body = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 4, "temperature": 1.0}

    async def run() -> None:
        ids = await sessions.create_many(2)
        assert len(set(ids)) == 2
        replies = await sessions.chat_many([(ids[0], body), ("no-such-session", body), (ids[1], body)], seeds=[1, 2, 1])
        assert type(replies[0]) is ChatTurn and type(replies[2]) is ChatTurn
        assert replies[0].message == replies[2].message  # the same prompt and seed: the same tokens
        assert isinstance(replies[1], SessionCallError) and replies[1].status == 404
        samples = await sessions.samples_many(ids)
        assert [len(s) for s in samples] == [1, 1] and samples[0][0].tokens == samples[1][0].tokens
        await sessions.delete(ids[0])
        with pytest.raises(SessionCallError) as raised:  # raised by the actor, returned, raised here again
            await sessions.samples(ids[0])
        assert raised.value.status == 404
        assert len(await sessions.samples(ids[1])) == 1
        with pytest.raises(SessionCallError) as raised:  # one session's turn: its failure raised
            await sessions.chat(ids[0], body)
        assert raised.value.status == 404
        one = await sessions.create()
        assert type(await sessions.chat(one, body)) is ChatTurn
        await sessions.delete_many([*ids, one])  # one already gone: fine, as over HTTP
        await sessions.aclose()

    asyncio.run(run())


def test_only_the_batch_calls_are_served(worker):
    with pytest.raises(ValueError, match="not a session batch call: 'service'"):
        worker.sessions_call("service", (), {})


def test_a_session_call_error_pickles_with_its_status():
    error = pickle.loads(pickle.dumps(SessionCallError("session POST /sessions: HTTP 429: too many", 429)))
    assert (type(error), str(error), error.status) == (SessionCallError, "session POST /sessions: HTTP 429: too many", 429)
