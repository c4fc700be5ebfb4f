"""Fuzzed request bodies: never a 500 or a stack trace, and a rejected request never changes the
session (its GET bytes are identical before and after)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=16, suite="stage-a-cpu")

ALLOWED = {200, 400, 409, 413, 422}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "", "USER"]) | st.text(max_size=6)
contents = (
    st.text(max_size=30)
    | st.none()
    | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=3)
    | json_values
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"function": st.fixed_dictionaries({"name": st.text(max_size=8), "arguments": st.text(max_size=20) | json_values})},
        optional={"id": st.text(max_size=6), "type": st.just("function") | st.text(max_size=5)},
    ),
    max_size=2,
)
messages = st.fixed_dictionaries(
    {"role": roles},
    optional={"content": contents, "tool_calls": tool_calls, "tool_call_id": st.text(max_size=5) | json_values, "name": json_values},
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "stream": st.booleans() | json_values,
        "n": st.integers(-1, 3) | json_values,
        "max_tokens": st.integers(-2, 40) | json_values,
        "tools": st.lists(st.dictionaries(st.text(max_size=5), json_values, max_size=2), max_size=2) | json_values,
        "chat_template_kwargs": st.dictionaries(st.text(max_size=12), json_values, max_size=2) | json_values,
        "input_ids": st.lists(st.integers(0, 300), max_size=3),
        "temperature": json_values,
    },
)


# hypothesis never draws surrogates as characters; JSON can still carry them as \udXXX escapes
surrogates = st.integers(0xD800, 0xDFFF).map(chr)
any_text = st.lists(st.characters() | surrogates, max_size=40).map("".join)
valid_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": any_text},
    optional={
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"function": st.fixed_dictionaries({"name": st.text(max_size=8), "arguments": any_text})}
            ),
            max_size=2,
        ),
        "tool_call_id": st.text(max_size=5),
    },
)
valid_fields = st.fixed_dictionaries(
    {},
    optional={"stream": st.booleans(), "max_tokens": st.integers(0, 40), "temperature": st.floats(0, 2)},
)


def _check(harness, sid, body: bytes) -> None:
    before = harness.state(sid).content
    response = harness.chat(sid, body)
    assert response.status_code in ALLOWED, (response.status_code, response.text[:300], body[:300])
    assert "Traceback" not in response.text
    if response.status_code == 200:
        return
    error = response.json()["error"]
    assert set(error) == {"type", "message"} and len(response.content) < 2048
    assert harness.state(sid).content == before, f"rejected body changed state: {body[:200]!r}"


@pytest.fixture(params=["v1", "v2"])
def session(request, serve):
    harness = serve(request.param)
    sid = harness.create()
    first = harness.chat(sid, {"messages": [{"role": "user", "content": "seed"}]})
    assert first.status_code == 200
    return harness, sid, [{"role": "user", "content": "seed"}, first.json()["choices"][0]["message"]]


@FUZZ
@given(tail=st.lists(messages, max_size=3), extra=fields, keep_history=st.booleans())
def test_structured_bodies(session, tail, extra, keep_history) -> None:
    harness, sid, history = session
    body = {"messages": (history if keep_history else []) + tail, **extra}
    _check(harness, sid, json.dumps(body).encode())


@FUZZ
@given(tail=st.lists(valid_messages, min_size=1, max_size=3), extra=valid_fields, keep_history=st.booleans())
def test_plausible_bodies(session, tail, extra, keep_history) -> None:
    """Mostly valid bodies with arbitrary text (control characters, surrogates, special tokens)."""
    harness, sid, history = session
    body = {"messages": (history if keep_history else []) + tail, **extra}
    _check(harness, sid, json.dumps(body).encode())


@FUZZ
@given(body=json_values | st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
def test_arbitrary_bodies(session, body) -> None:
    harness, sid, _ = session
    raw = body.encode("latin-1", "replace") if isinstance(body, str) else json.dumps(body).encode()
    _check(harness, sid, raw)


@pytest.mark.parametrize("literal", [b"1e400", b"-1e400"])
def test_numbers_beyond_a_float_are_refused(serve, literal) -> None:
    """Python reads them as infinity, which no JSON encoder writes back: 400, not a 500 later."""
    harness = serve("v1")
    sid = harness.create()
    before = harness.state(sid).content
    response = harness.chat(sid, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + literal + b"}")
    assert response.status_code == 400 and "out of range" in response.json()["error"]["message"]
    assert harness.state(sid).content == before
