"""The typed completion extractor and the neutral token invariants."""

import copy

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.session.completion import client_reply, extract_completion
from miles_core.session.errors import UpstreamFailure
from miles_core.session.tokens import TokenInvariantError, check_aligned, check_extends, first_mismatch
from miles_core.testing.engine_stub import chat_reply

register_cpu_ci(est_time=2, suite="stage-a-cpu")

GOOD = chat_reply("r1", {"role": "assistant", "content": "hi"}, [104, 105, 258], "stop", prompt_tokens=4)
VOCAB = 400


def extract(reply):
    return extract_completion(reply, vocab_size=VOCAB)


def test_extracts_ids_logprobs_and_metadata() -> None:
    completion = extract(GOOD)
    assert completion.token_ids == (104, 105, 258)
    assert completion.logprobs == (-0.125, -0.25, -0.375)
    assert completion.message == {"role": "assistant", "content": "hi"}
    assert completion.finish_reason == "stop" and completion.weight_version == "stub-0"
    assert not completion.truncated


def _broken(mutate):
    reply = copy.deepcopy(GOOD)
    mutate(reply)
    with pytest.raises(UpstreamFailure) as info:
        extract(reply)
    assert info.value.status == 502
    return str(info.value)


def _meta(reply):
    return reply["choices"][0]["meta_info"]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda r: r.pop("choices"), "no choices"),
        (lambda r: r.update(choices=[]), "no choices"),
        (lambda r: r.update(choices=["x"]), "choices[0] is not an object"),
        (lambda r: r["choices"][0].pop("message"), "message is missing"),
        (lambda r: r["choices"][0].pop("meta_info"), "meta_info is missing"),
        (lambda r: _meta(r).pop("output_token_logprobs"), "output_token_logprobs is missing"),
        (lambda r: _meta(r).update(output_token_logprobs=[[-0.1]]), "is not a [logprob, token_id] pair"),
        (lambda r: _meta(r).update(output_token_logprobs=[[-0.1, "7"]]), "token id '7'"),
        (lambda r: _meta(r).update(output_token_logprobs=[[-0.1, -7]]), "token id -7"),
        (lambda r: _meta(r).update(output_token_logprobs=[[0.5, 7]]), "log-prob 0.5"),
        (lambda r: _meta(r).update(output_token_logprobs=[[float("inf"), 7]]), "log-prob inf"),
        (lambda r: _meta(r).update(output_token_logprobs=[[True, 7]]), "log-prob True"),
        (lambda r: (_meta(r).pop("completion_tokens"), r.pop("usage")), "completion_tokens is missing"),
        (lambda r: _meta(r).update(completion_tokens=4), "completion_tokens=4 but output_token_logprobs has 3"),
        (lambda r: r["choices"][0]["message"].update(content=None), "neither content nor tool_calls"),
        (lambda r: r["choices"][0]["message"].update(content=["x"]), "content is not a string"),
        (lambda r: r["choices"][0]["message"].update(tool_calls=[{"function": {}}]), "tool_calls is not a list"),
        (lambda r: r["choices"][0].update(finish_reason=3), "finish_reason is not a string"),
    ],
)
def test_every_contract_break_is_a_502(mutate, expected) -> None:
    assert expected in _broken(mutate)


def _ids(*ids):
    return lambda r: (_meta(r).update(output_token_logprobs=[[-0.5, i] for i in ids], completion_tokens=len(ids)))


@pytest.mark.parametrize(
    ("ids", "bad"),
    [((2**70,), 2**70), ((10**9,), 10**9), ((VOCAB,), VOCAB), ((1, 2, VOCAB + 5, 3), VOCAB + 5)],
    ids=["2**70", "1e9", "vocab_size", "one-among-many"],
)
def test_token_ids_outside_the_vocabulary_are_a_502(ids, bad) -> None:
    index = ids.index(bad)
    message = _broken(_ids(*ids))
    assert f"output_token_logprobs[{index}] token id {bad} is outside the tokenizer's vocabulary (400 ids: 0..399)" in message


def test_the_last_id_of_the_vocabulary_is_accepted() -> None:
    reply = copy.deepcopy(GOOD)
    _ids(0, VOCAB - 1)(reply)
    assert extract(reply).token_ids == (0, VOCAB - 1)


def _empty(finish_reason, content="", **message):
    def mutate(reply):
        _ids()(reply)
        reply["choices"][0]["finish_reason"] = finish_reason
        reply["choices"][0]["message"] = {"role": "assistant", "content": content, **message}

    return mutate


def test_an_empty_completion_cut_by_its_token_limit_is_a_turn() -> None:
    reply = copy.deepcopy(GOOD)
    _empty("length")(reply)
    completion = extract(reply)
    assert completion.token_ids == () and completion.logprobs == () and completion.truncated
    assert completion.message == {"role": "assistant", "content": ""}


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_empty("stop"), "finish_reason='stop' (only a completion its token limit ended may be empty)"),
        (_empty(None), "finish_reason=None"),
        (_empty("length", "text without tokens"), "a message with text or tool calls"),
        (_empty("length", None, tool_calls=[{"function": {"name": "f", "arguments": "{}"}}]), "with text or tool calls"),
    ],
    ids=["stop", "no-reason", "text", "tool-call"],
)
def test_other_empty_completions_are_a_502(mutate, expected) -> None:
    message = _broken(mutate)
    assert "empty completion" in message and expected in message


def test_error_messages_are_bounded() -> None:
    message = _broken(lambda r: _meta(r).update(output_token_logprobs=[[-0.1, "x" * 100_000]]))
    assert len(message) < 1200


def test_client_reply_strips_replay_data_without_touching_the_record() -> None:
    reply = client_reply(GOOD)
    assert "routed_experts" not in reply["choices"][0]["meta_info"]
    assert GOOD["choices"][0]["meta_info"]["routed_experts"] == "AAEC"


def test_check_extends() -> None:
    check_extends([1, 2, 3], [1, 2, 3, 4])
    check_extends([1, 2, 3], [1, 2, 9], trim=1)
    with pytest.raises(TokenInvariantError, match="first difference at index 2"):
        check_extends([1, 2, 3], [1, 2, 9, 4])
    # The new sequence is a strict prefix: a typed error, not a crash (an upstream bug).
    with pytest.raises(TokenInvariantError, match="first difference at index 2"):
        check_extends([1, 2, 3, 4], [1, 2])
    with pytest.raises(TokenInvariantError, match="trim=5"):
        check_extends([1, 2], [1, 2], trim=5)
    huge = list(range(200_000))
    with pytest.raises(TokenInvariantError) as info:
        check_extends(huge, [*huge[:-1], -1])
    assert len(str(info.value)) < 400


def test_first_mismatch_and_alignment() -> None:
    assert first_mismatch([1, 2], [1, 2]) is None
    assert first_mismatch([1, 2], [1, 3]) == 1
    assert first_mismatch([1, 2], [1]) == 1
    check_aligned([1, 2], [-0.1, -0.2])
    with pytest.raises(TokenInvariantError, match="2 token id"):
        check_aligned([1, 2], [-0.1])


def test_client_reply_keeps_openai_logprobs_only_when_asked() -> None:
    reply = copy.deepcopy(GOOD)
    reply["choices"][0]["logprobs"] = {"content": [{"token": "h", "logprob": -0.1, "bytes": [104], "top_logprobs": []}]}
    assert client_reply(reply)["choices"][0]["logprobs"] == reply["choices"][0]["logprobs"]
    stripped = client_reply(reply, logprobs=False)
    assert stripped["choices"][0]["logprobs"] is None
    assert reply["choices"][0]["logprobs"] is not None  # the record keeps what the engine sent
    assert stripped["choices"][0]["meta_info"]["output_token_logprobs"]  # token-level data is kept


def test_in_process_completions_are_held_to_the_same_rules() -> None:
    from miles_core.session.completion import check_sampled, make_completion

    check_sampled((104, 105), (-0.5, -0.25), VOCAB)
    for ids, logprobs, expected in [
        ((104, VOCAB), (-0.5, -0.25), f"token id {VOCAB} is outside the tokenizer's vocabulary"),
        ((104,), (0.5,), "log-prob 0.5"),
        ((104, 105), (-0.5,), "2 token ids but 1 log-probs"),
    ]:
        with pytest.raises(UpstreamFailure, match=expected):
            check_sampled(ids, logprobs, VOCAB)
    with pytest.raises(UpstreamFailure, match="empty completion"):
        make_completion({"role": "assistant", "content": ""}, (), (), "stop", "0")
    assert make_completion({"role": "assistant", "content": "", "tool_calls": None}, (), (), "length", 3).weight_version == "3"
