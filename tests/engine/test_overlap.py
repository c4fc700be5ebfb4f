"""Overlapped decode steps (``overlap_steps``): step ``t + 1`` is launched before step ``t``'s
tokens are read. On by default only on GPUs; forced on here, on CPU, where the loop's logic is
the same: the completions must equal the plain loop's."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.base import Completion, GenerationRequest, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig, RequestAborted
from miles_core.errors import ConfigError

register_cpu_ci(est_time=20, suite="stage-a-cpu")


@pytest.fixture(scope="module")
def engines(tiny_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    with Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=16, overlap_steps=False)) as plain, \
            Engine.from_pretrained(tiny_dir, EngineConfig(max_batch_size=16, overlap_steps=True)) as overlapped:
        yield plain, overlapped


def _mixed_requests(engine: Engine, n: int, seed: int) -> list[GenerationRequest]:
    """Every way a sequence stops: length (each its own), EOS, a stop id, a stop string."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 40))]
        kind = i % 4
        params = SamplingParams(
            max_tokens=rng.randint(1, 40), seed=seed + i, temperature=(1.2, 0.8, 0.0, 1.0)[kind],
            top_p=0.9 if kind == 1 else 1.0, ignore_eos=kind == 3,
            stop_token_ids=(rng.randrange(256),) if kind == 0 else (),
            stop=(engine.tokenizer.decode([rng.randrange(33, 127)]),) if kind == 3 else (),
        )
        requests.append(GenerationRequest(prompt, params))
    return requests


def _same(a: list[Completion], b: list[Completion]) -> None:
    # tokens and stops exactly; log-probs within the bound the batched-vs-alone test allows: the
    # overlapped loop's steps carry the discarded rows of just-stopped sequences, so a step's
    # matrices have other shapes than the plain loop's
    assert [(c.token_ids, c.finish_reason, c.matched_stop, c.seed) for c in a] == \
        [(c.token_ids, c.finish_reason, c.matched_stop, c.seed) for c in b]
    assert max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca.logprobs, cb.logprobs)) <= 1e-5


def test_overlapped_steps_give_the_plain_loops_completions(engines: tuple[Engine, Engine]) -> None:
    plain, overlapped = engines
    assert (plain.runner_info()["overlap_steps"], overlapped.runner_info()["overlap_steps"]) == (False, True)
    requests = _mixed_requests(plain, 40, seed=11)  # more than 16 rows: sequences queue for freed rows
    expected = plain.generate(requests)
    assert {c.finish_reason for c in expected} == {"length", "stop"}
    _same(overlapped.generate(requests), expected)


def test_the_overlapped_loop_launches_the_next_step_before_reading_the_last(engines: tuple[Engine, Engine]) -> None:
    """Equal lengths: the plain loop needs ``max_tokens - 1`` decode steps, the overlapped one has
    launched one more (discarded) by the time it reads that every row stopped."""
    requests = [GenerationRequest(p, SamplingParams(max_tokens=9, seed=i, ignore_eos=True))
                for i, p in enumerate([[1, 2, 3], [4, 5], [6]])]
    steps = []
    for engine in engines:
        before = engine.stats()
        completions = engine.generate(requests)
        after = engine.stats()
        steps.append(after["decode_steps"] - before["decode_steps"])
        assert after["generated_tokens"] - before["generated_tokens"] == 27 == sum(c.completion_tokens for c in completions)
    assert steps == [8, 9]


def test_requests_join_and_abort_while_steps_overlap(engines: tuple[Engine, Engine]) -> None:
    _, overlapped = engines
    long = GenerationRequest([9, 8, 7, 6], SamplingParams(max_tokens=50, seed=1, ignore_eos=True))
    shorts = [GenerationRequest([i + 1, i + 2], SamplingParams(max_tokens=4, seed=i, ignore_eos=True)) for i in range(5)]
    solo = [overlapped.generate([r])[0] for r in (long, *shorts)]
    before = overlapped.stats()["prefills"]
    long_future = overlapped.submit(long)
    while overlapped.stats()["prefills"] == before:
        threading.Event().wait(0.001)
    joined = [overlapped.submit(r).result(30) for r in shorts]
    assert long_future.result(30).token_ids == solo[0].token_ids
    assert [c.token_ids for c in joined] == [c.token_ids for c in solo[1:]]

    endless = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=1500, ignore_eos=True))
    first, second = overlapped.submit_many([endless, endless])
    while overlapped.stats()["running"] < 2:
        threading.Event().wait(0.001)
    overlapped.abort(first)
    with pytest.raises(RequestAborted):
        first.result(30)
    overlapped.abort(second)
    with pytest.raises(RequestAborted):
        second.result(30)
    assert overlapped.stats()["running"] == 0
    assert overlapped.generate([shorts[0]])[0].token_ids == solo[1].token_ids


def test_overlap_steps_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match="overlap_steps"):
        EngineConfig(overlap_steps="yes")  # type: ignore[arg-type]
