"""The pure request normalizer and message matching."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.ci.register import register_cpu_ci
from miles_core.session.errors import InvalidRequest
from miles_core.session.messages import RENDERED_FIELDS, canonical_message, message_key, text_of
from miles_core.session.normalize import (
    FORCED_UPSTREAM_FLAGS,
    normalize_chat_request,
    normalize_samples_request,
    upstream_body,
)

register_cpu_ci(est_time=4, suite="stage-a-cpu")


def _normalize(body):
    return normalize_chat_request(json.dumps(body).encode())


def _rejected(body: bytes | dict) -> str:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(InvalidRequest) as info:
        normalize_chat_request(raw)
    return str(info.value)


def test_split_by_consumer() -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": False},
        "temperature": 0.3,
    }
    request = _normalize(body)
    assert request.messages == ({"role": "user", "content": "ab"},)
    assert request.stream and request.include_usage
    assert request.template_kwargs == {"enable_thinking": False}
    assert "stream" not in request.forward and request.forward["temperature"] == 0.3
    sent = upstream_body(request, (5, 6))
    assert sent["input_ids"] == [5, 6] and sent["messages"] == body["messages"]
    assert {k: sent[k] for k in FORCED_UPSTREAM_FLAGS} == FORCED_UPSTREAM_FLAGS


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"", "messages: Field required"),
        (b"{", "not valid JSON"),
        (b"[1]", "must be a JSON object, got an array"),
        (b'{"messages": NaN}', "NaN is not a valid JSON value"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "unpaired UTF-16 surrogate"),
        (b"[" * 100_000, "nested too deeply"),
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role: Input should be"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream: Input should be a valid boolean"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n: Input should be 1"),
        ({"messages": [{"role": "user", "content": "x"}], "input_ids": [1]}, "input_ids: is set by the session server"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "tool_calls[0].function.name"),
    ],
)
def test_rejections_name_the_field(body, expected) -> None:
    message = _rejected(body)
    assert expected in message, message
    assert len(message) <= 1100


def test_equivalent_spellings_match() -> None:
    sent = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": [2]}'}}],
    }
    echoed = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": [2], "b": 1}}}]}
    assert message_key(sent) == message_key(echoed)
    changed = {**echoed, "tool_calls": [{"function": {"name": "f", "arguments": {"a": [3], "b": 1}}}]}
    assert message_key(sent) != message_key(changed)
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert message_key(parts) == message_key({"role": "user", "content": "hi"})
    assert message_key(parts) != message_key({"role": "system", "content": "hi"})


def test_samples_options() -> None:
    assert normalize_samples_request(b"").max_seq_len is None
    options = normalize_samples_request(b'{"max_seq_len": 10, "metadata": {"reward": 1}}')
    assert options.max_seq_len == 10 and options.metadata == {"reward": 1}
    for body, expected in [
        (b'{"max_seq_len": 0}', "max_seq_len: Input should be greater than or equal to 1"),
        (b'{"max_seq_len": true}', "max_seq_len"),
        (b'{"other": 1}', "other: Extra inputs are not permitted"),
        (b'{"metadata": {"turns": 1}}', "metadata.turns is set by the session server"),
    ]:
        with pytest.raises(InvalidRequest, match=expected):
            normalize_samples_request(body)


_fields = st.none() | st.text(max_size=4) | st.just([]) | st.lists(st.text(max_size=3), max_size=2)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool"])},
        optional={
            "content": st.none() | st.text(max_size=5) | st.just([{"type": "text", "text": "p"}]),
            "name": _fields,
            "tool_call_id": _fields,
            "reasoning_content": _fields,
            "refusal": _fields,
            "tool_calls": st.none() | st.just([]) | st.just([{"function": {"name": "f", "arguments": '{"a": 1}'}}]),
        },
    )
)
def test_canonical_message_keeps_exactly_the_rendered_fields(message) -> None:
    expected = {"role": message["role"], "content": text_of(message.get("content"))}
    expected.update({k: message[k] for k in RENDERED_FIELDS if message.get(k) is not None and message.get(k) != []})
    assert canonical_message(message) == expected
    calls = tuple(("f", '{"a":1}') for _ in message.get("tool_calls") or ())
    key = (message["role"], expected["content"], message.get("name"), message.get("tool_call_id"), calls)
    assert message_key(message) == key


# -- what a session's History and the first-turn cache skip must not change anything -----------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(-2, 2, allow_nan=False), st.text(max_size=3))
_arguments = st.one_of(st.text(max_size=6), st.dictionaries(st.sampled_from("ab"), _scalars, max_size=2))
_tool_call = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]), "arguments": _arguments})},
    optional={"id": st.one_of(st.none(), st.text(max_size=3)), "type": st.sampled_from(["function", "other"])},
)
_content = st.one_of(
    st.none(), st.text(max_size=4), st.integers(0, 2),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=3)}), max_size=2),
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"])},
    optional={
        "content": _content,
        "name": st.one_of(st.none(), st.text(max_size=3), st.integers(0, 1)),
        "tool_calls": st.one_of(st.none(), st.lists(_tool_call, max_size=2)),
        "tool_call_id": st.one_of(st.none(), st.text(max_size=3)),
        "refusal": st.none(),
    },
)


def _outcome(raw, history=None):
    from miles_core.session.normalize import normalize_chat_object

    try:
        return normalize_chat_object(json.loads(json.dumps(raw)), history)
    except InvalidRequest as exc:
        return str(exc)


def _echo(message, how):
    """``message`` as a client might send it back."""
    if how == "same":
        return message
    if how == "nulls":
        return {**message, "tool_calls": message.get("tool_calls"), "name": message.get("name"), "refusal": None}
    if how == "parts" and isinstance(message.get("content"), str):
        return {**message, "content": [{"type": "text", "text": message["content"]}]}
    if how == "numbers":  # the same JSON text value, another JSON type: must not be taken as a repeat
        return _retyped(message)
    return message


def _retyped(value):
    """``value`` with ``true`` sent as ``1`` and ``1`` as ``1.0`` (equal in Python, not in JSON)."""
    if value is True:
        return 1
    if type(value) is int and value == 1:
        return 1.0
    if isinstance(value, dict):
        return {key: _retyped(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_retyped(item) for item in value]
    return value


@settings(max_examples=300, deadline=None)
@given(
    previous=st.lists(_message, min_size=1, max_size=4),
    assistant=_message,
    echo=st.lists(st.sampled_from(["same", "nulls", "parts", "numbers"]), min_size=6, max_size=6),
    cut=st.integers(0, 6),
    tail=st.lists(_message, max_size=2),
    extra=st.dictionaries(st.sampled_from(["n", "stream", "max_tokens", "input_ids"]), _scalars, max_size=1),
)
def test_history_changes_neither_result_nor_error(previous, assistant, echo, cut, tail, extra) -> None:
    from miles_core.session.normalize import History, normalize_chat_object

    first = _outcome({"messages": previous})
    if isinstance(first, str):
        return  # a session's history is made of requests it accepted
    assistant = {**assistant, "role": "assistant"}
    history = History.after(first.messages, first.keys, assistant, repeated=0)
    resent = [_echo(m, how) for m, how in zip([*previous, assistant], echo)][:cut] + tail
    body = {"messages": resent, **extra}
    with_history, without = _outcome(body, history), _outcome(body)
    assert with_history == without
    if not isinstance(without, str):
        again = normalize_chat_object(json.loads(json.dumps(body)))  # the first-turn cache, warm now
        assert again == without


def test_the_first_turn_cache_keys_on_json_types() -> None:
    """A conversation validated once is reused only for the same JSON, types included: an
    in-process caller's tuple, or 1 where 1.0 was, goes through validation again."""
    from miles_core.session.normalize import normalize_chat_object

    messages = [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1.0}}}]}]
    accepted = normalize_chat_object({"messages": messages})
    assert normalize_chat_object({"messages": messages}) == accepted
    with pytest.raises(InvalidRequest, match="messages"):
        normalize_chat_object({"messages": tuple(messages)})
    with_int = normalize_chat_object({"messages": [{**messages[0], "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}]})
    assert with_int.keys != accepted.keys  # {"a": 1} and {"a": 1.0} render differently


def test_a_repeated_history_is_not_validated_again() -> None:
    """The point of History: a resent conversation costs its new messages only."""
    from miles_core.session import normalize

    first = normalize.normalize_chat_object({"messages": [{"role": "user", "content": f"q{i}"} for i in range(50)]})
    history = normalize.History.after(first.messages, first.keys, {"role": "assistant", "content": "a"}, repeated=0)
    resent = [*({"role": "user", "content": f"q{i}"} for i in range(50)), {"role": "assistant", "content": "a", "tool_calls": None}]
    request = normalize.normalize_chat_object({"messages": [*resent, {"role": "user", "content": "next"}]}, history)
    assert request.repeated == 51 and request.messages[:51] == history.messages
    assert all(a is b for a, b in zip(request.messages, history.messages))  # the same objects, not copies


def test_a_batch_normalizes_each_body_as_alone_and_names_the_seed_variants() -> None:
    from miles_core.session.errors import InvalidRequest
    from miles_core.session.normalize import History, normalize_chat_object, normalize_chat_objects

    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    history = History.after((), (), {"role": "assistant", "content": "x"}, repeated=0)
    bodies = [
        {"messages": messages, "max_tokens": 3, "seed": 1, "tools": tools},
        {"messages": messages, "max_tokens": 3, "seed": 2, "tools": tools},  # a variant of the one before
        {"messages": messages, "max_tokens": 3, "tools": tools, "seed": 9, "stream": True},  # another field: not one
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 4, "tools": tools},  # equal, not the same
        {"messages": messages, "max_tokens": 3, "seed": 5, "tools": tools},  # another history below
        {"messages": [{"role": "robot"}], "seed": 6},
        {"messages": [{"role": "robot"}], "seed": 7},  # after an error: validated again, and fails again
        {"messages": messages, "seed": 8},
        {"messages": messages, "seed": 8, "n": 2},  # the one field that differs is validated
    ]
    histories = [None, None, None, None, history, None, None, None, None]
    batch = normalize_chat_objects(bodies, histories)
    for body, past, got in zip(bodies, histories, batch, strict=True):
        try:
            alone = normalize_chat_object(body, past)
        except InvalidRequest as exc:
            assert isinstance(got, InvalidRequest) and got.message == exc.message
            continue
        assert got == alone and got.forward == alone.forward
    assert [r.variant_of is batch[0] for r in batch[:2]] == [False, True]
    assert all(getattr(r, "variant_of", None) is None for r in batch[2:])
