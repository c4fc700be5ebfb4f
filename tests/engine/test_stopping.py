"""Stop conditions in isolation (a character-level 'tokenizer' keeps the cases readable)."""

from __future__ import annotations

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.base import SamplingParams
from miles_core.engine.stopping import Stop, StopChecker

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _run(params: SamplingParams, text: str, *, eos=(0,), room: int = 1000) -> tuple[Stop | None, int]:
    checker = StopChecker(params, eos_token_ids=eos, room=room, decode=lambda ids: "".join(map(chr, ids)))
    tokens: list[int] = []
    for ch in text:
        tokens.append(ord(ch))
        stop = checker.check(tokens)
        if stop is not None:
            assert checker.may_stop(tokens[-1], len(tokens))  # the engine's pre-test lets it through
            return stop, len(tokens)
    return None, len(tokens)


def test_the_pre_test_only_skips_steps_that_cannot_stop() -> None:
    plain = StopChecker(SamplingParams(max_tokens=3), eos_token_ids=(0,), room=1000, decode=lambda ids: "")
    assert not plain.may_stop(5, 1) and plain.may_stop(0, 1) and plain.may_stop(5, 3)
    strings = StopChecker(SamplingParams(stop=("x",)), eos_token_ids=(0,), room=1000, decode=lambda ids: "")
    assert strings.may_stop(5, 1)  # stop strings need the decoded text every step


def test_earliest_stop_string_wins_even_when_a_later_one_completes_first() -> None:
    assert _run(SamplingParams(stop=("xyz", "y")), "abxyz") == (Stop("stop", "y"), 4)
    assert _run(SamplingParams(stop=("cd", "bcde")), "abcde") == (Stop("stop", "cd"), 4)


def test_stop_string_spanning_tokens_and_max_tokens_and_room() -> None:
    assert _run(SamplingParams(stop=("END",)), "the END") == (Stop("stop", "END"), 7)
    assert _run(SamplingParams(max_tokens=3), "abcdef") == (Stop("length"), 3)
    assert _run(SamplingParams(max_tokens=10), "abcdef", room=2) == (Stop("length"), 2)


def test_eos_and_stop_ids() -> None:
    assert _run(SamplingParams(), "ab\x00c") == (Stop("stop", 0), 3)
    assert _run(SamplingParams(ignore_eos=True), "ab\x00c") == (None, 4)
    assert _run(SamplingParams(ignore_eos=True, stop_token_ids=(ord("c"),)), "ab\x00cd") == (Stop("stop", ord("c")), 4)
