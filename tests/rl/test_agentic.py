"""Agentic episodes through the session server: multi-turn tool use with the tool run in the local
sandbox, token-exact samples (observation tokens untrained), and the same seeds -> same episodes."""

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-cpu")

pytest.importorskip("miles_core.session.embed")
pytest.importorskip("miles_core.testing.engine_stub")

LOOKUP = """\
import json, sys
args = json.load(open(sys.argv[1]))
print("found " + args["query"].upper(), end="")
"""


@pytest.fixture
def agentic(tmp_path):
    from contextlib import ExitStack

    from transformers import AutoTokenizer

    from miles_core.assets.tiny_tokenizer import tiny_tokenizer_dir
    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.aio import BackgroundLoop
    from miles_core.rl.config import load_config
    from miles_core.rl.rollout.agentic import AgenticRollout, tool_sandbox
    from miles_core.rl.tasks import SandboxTool
    from miles_core.session.config import SessionServerConfig
    from miles_core.session.embed import serve_in_thread
    from miles_core.session.tokenizer import ChatTokenizer
    from miles_core.testing.engine_stub import ScriptedChat, StubEngine

    directory = tiny_tokenizer_dir()
    config = load_config("tiny", overrides=["rollout.max_turns=3", "rollout.max_new_tokens=64"])
    pm = get_plugin_manager()
    tool = SandboxTool("lookup", "look a word up", {"type": "object", "properties": {"query": {"type": "string"}}}, LOOKUP)
    with ExitStack() as stack:
        stub = stack.enter_context(StubEngine(ScriptedChat(ChatTokenizer.from_dir(directory))))
        url = stack.enter_context(serve_in_thread(SessionServerConfig(upstream_url=stub.url, tokenizer_dir=directory), pm=pm))
        aio = BackgroundLoop()
        stack.callback(aio.close)
        sandbox = tool_sandbox(config, pm, aio, [tool])
        stack.callback(sandbox.close)
        rollout = AgenticRollout(url, AutoTokenizer.from_pretrained(directory), config.rollout, 0, aio, [tool], sandbox)
        stack.callback(rollout.close)
        yield rollout


def test_multi_turn_tool_episode_is_recorded_token_exactly(agentic):
    from miles_core.rl.tasks import Prompt

    prompt = Prompt(id="q", text="call gpu", answer="", messages=({"role": "user", "content": "call gpu"},))
    (episode,) = agentic.run([prompt], step=0)
    assert episode.turns == 2  # a tool call, then an answer that reads the tool's output
    assert "found GPU" in episode.completion  # the sandboxed tool ran and the model saw its result
    mask = episode.loss_mask
    assert len(mask) == len(episode.rollout_logprobs) == episode.response_length
    trained, untrained = sum(mask), len(mask) - sum(mask)
    assert trained > 0 and untrained > 0  # the tool observation is in the response, not trained
    assert all(lp == 0.0 for lp, m in zip(episode.rollout_logprobs, mask) if not m)
    assert all(lp < 0 for lp, m in zip(episode.rollout_logprobs, mask) if m)
    again = agentic.run([prompt], step=0)[0]
    assert again.token_ids == episode.token_ids and again.loss_mask == episode.loss_mask


def test_the_agentic_rollout_function_conforms_against_a_session_server(tmp_path):
    """The rollout-function kit on ``agentic``, its context pointing at a session server in front
    of the scripted engine stub (what an orchestrator that runs the server elsewhere passes)."""
    from contextlib import ExitStack

    from transformers import AutoTokenizer

    from miles_core.assets.tiny_tokenizer import tiny_tokenizer_dir
    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.rollout.builtin import AgenticRolloutFunction
    from miles_core.session.config import SessionServerConfig
    from miles_core.session.embed import serve_in_thread
    from miles_core.session.tokenizer import ChatTokenizer
    from miles_core.testing.engine_stub import ScriptedChat, StubEngine
    from miles_core.testing.rollout import assert_rollout_conforms, make_context

    directory = tiny_tokenizer_dir()
    with ExitStack() as stack:
        stub = stack.enter_context(StubEngine(ScriptedChat(ChatTokenizer.from_dir(directory))))
        url = stack.enter_context(serve_in_thread(SessionServerConfig(upstream_url=stub.url, tokenizer_dir=directory),
                                                  pm=get_plugin_manager()))
        context = make_context(tokenizer=AutoTokenizer.from_pretrained(directory), model_dir=directory,
                               session_url=url)
        stack.callback(context.aio.close)
        trajectories = assert_rollout_conforms(AgenticRolloutFunction(), context)
    assert len(trajectories) == 6 and all(t.turns == 1 for t in trajectories)


def test_in_process_sessions_need_the_embedded_engine():
    """Without a session server, another engine is refused before anything starts (it failed
    later, inside the session upstream, on an attribute only the embedded engine has)."""
    from miles_core.rl.rollout.agentic import AgenticRollout
    from miles_core.testing.rollout import make_context

    context = make_context()
    try:
        with pytest.raises(TypeError, match="session_url"):
            AgenticRollout.start(context)
    finally:
        context.aio.close()


@pytest.fixture(scope="module")
def tiny_engine():
    pytest.importorskip("torch")
    import torch

    from miles_core.engine.engine import Engine, EngineConfig
    from miles_core.engine.presets import preset_dir

    torch.set_num_threads(1)
    directory = preset_dir("tiny")
    with Engine.from_pretrained(directory, EngineConfig(max_batch_size=16)) as engine:
        yield engine, directory


def test_in_process_sessions_equal_a_session_server(tiny_engine):
    """``miles train``'s agentic rollout calls the session service in this process (no server);
    its trajectories are those of the same engine behind a session server over HTTP, seed for
    seed: the same tokens, masks and texts, and log-probs equal up to the float noise of other
    batch shapes (requests reach the engine in other groups over HTTP: fp32 sums in another
    order, ~1e-7 relative here)."""
    from contextlib import ExitStack

    from transformers import AutoTokenizer

    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.rollout.agentic import AgenticRollout
    from miles_core.session.client import LocalSessions
    from miles_core.session.config import SessionServerConfig
    from miles_core.session.embed import serve_in_thread
    from miles_core.session.upstream import EngineUpstream
    from miles_core.testing.rollout import PROMPTS, make_context

    engine, directory = tiny_engine
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with ExitStack() as stack:
        context = make_context(engine=engine, tokenizer=tokenizer, model_dir=directory)
        stack.callback(context.aio.close)
        local = AgenticRollout.start(context)
        stack.callback(local.close)
        assert isinstance(local.sessions, LocalSessions)  # no server was started
        url = stack.enter_context(serve_in_thread(
            SessionServerConfig(upstream_url="http://engine.in-process", tokenizer_dir=directory), pm=get_plugin_manager(),
            upstream=lambda tok: EngineUpstream(engine, vocab_size=tok.vocab_size),
        ))
        remote = AgenticRollout(url, tokenizer, context.config.rollout, context.config.run.seed, context.aio)
        stack.callback(remote.close)
        batch = [p for p in PROMPTS for _ in range(2)]
        here, there = local.run(batch, step=3), remote.run(batch, step=3)
        assert local.run(batch, step=3) == here  # the same batch the same way: bitwise the same
    for a, b in zip(here, there, strict=True):
        assert (a.token_ids, a.loss_mask, a.completion, a.first_token, a.finish_reason, a.weight_version) == (
            b.token_ids, b.loss_mask, b.completion, b.first_token, b.finish_reason, b.weight_version)
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) <= 1e-5
    assert len({t.token_ids for t in here}) > 1  # different seeds sampled different episodes


def test_episodes_in_groups_equal_all_at_once(tiny_engine):
    """``rollout.concurrency`` only groups the episodes (each group's phases one call each): seed
    for seed the same episodes as the whole step at once, log-probs up to the float noise of
    other batch shapes."""
    from transformers import AutoTokenizer

    from miles_core.rl.rollout.agentic import AgenticRollout
    from miles_core.testing.rollout import PROMPTS, make_context

    engine, directory = tiny_engine
    tokenizer = AutoTokenizer.from_pretrained(directory)
    batch = [p for p in PROMPTS for _ in range(3)]
    runs = []
    for concurrency in (None, 4):
        context = make_context(engine=engine, tokenizer=tokenizer, model_dir=directory, concurrency=concurrency)
        rollout = AgenticRollout.start(context)
        try:
            runs.append(rollout.run(batch, step=5, first_index=2))
        finally:
            rollout.close()
            context.aio.close()
    together, grouped = runs
    assert len(together) == len(batch) and len({t.token_ids for t in together}) > 1
    for a, b in zip(together, grouped, strict=True):
        assert (a.prompt, a.token_ids, a.loss_mask, a.completion, a.first_token, a.turns, a.finish_reason) == (
            b.prompt, b.token_ids, b.loss_mask, b.completion, b.first_token, b.turns, b.finish_reason)
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) <= 1e-5


def test_young_collections_are_deferred_only_while_episodes_run():
    import gc

    from miles_core.rl.rollout.agentic import young_collections_deferred

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])
        with young_collections_deferred(9000):
            assert gc.get_threshold() == (9000, *before[1:])
        assert gc.get_threshold() == (700, *before[1:])
        with pytest.raises(KeyError), young_collections_deferred(9000):
            raise KeyError("an episode failed")
        assert gc.get_threshold() == (700, *before[1:])
        gc.set_threshold(20000, *before[1:])
        with young_collections_deferred(9000):  # never lowered
            assert gc.get_threshold()[0] == 20000
    finally:
        gc.set_threshold(*before)
