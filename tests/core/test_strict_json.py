"""strict_json: loads refuses what cannot be encoded again; dumps (orjson, with json as the
fallback) writes the bytes json would, differing only in how exponents are spelled."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core import strict_json
from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-a-cpu")


def _stdlib(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _json_values(scalars):
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=16,
    )


# integers beyond 64 bits take the json fallback; text covers control characters and non-ASCII
exact_values = _json_values(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=20))
float_values = _json_values(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**70), 2**70))


@settings(max_examples=300, deadline=None)
@given(exact_values)
def test_dumps_writes_the_bytes_json_writes(value) -> None:
    assert strict_json.dumps(value) == _stdlib(value)


@settings(max_examples=300, deadline=None)
@given(float_values)
def test_dumps_round_trips_floats_exactly(value) -> None:
    encoded = strict_json.dumps(value)
    assert json.loads(encoded) == value
    assert strict_json.loads(encoded) == value


def test_exponents_are_the_only_spelling_difference() -> None:
    assert strict_json.dumps([1e-05, 2.5e-08, 0.1, 1e16]) == b"[0.00001,2.5e-8,0.1,1e+16]"
    assert _stdlib([1e-05, 2.5e-08, 0.1, 1e16]) == b"[1e-05,2.5e-08,0.1,1e+16]"


def test_nesting_beyond_orjson_falls_back_and_beyond_json_is_a_value_error() -> None:
    deep = []
    for _ in range(300):  # orjson stops at 254 levels
        deep = [deep]
    assert strict_json.dumps(deep) == _stdlib(deep)
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match="nested too deeply"):
        strict_json.dumps(deep)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"[1e400]", "out of range"),
        (b'{"t": -1e400}', "out of range"),
        (b"[1.7976931348623159e308]", "out of range"),  # rounds past the largest double
        (b"[" + b"9" * 400 + b".0]", "out of range"),
        (b"[NaN]", "NaN is not a valid JSON value"),
        (b"[-Infinity]", "-Infinity is not a valid JSON value"),
        (b'["\\ud800"]', "surrogate"),
        (b"[" * 100_000, "nested too deeply"),
    ],
)
def test_loads_refuses_what_cannot_be_encoded_again(text: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        strict_json.loads(text)


def test_loads_keeps_large_numbers_exact() -> None:
    assert strict_json.loads(b"[1.7976931348623157e308, 123456789012345678901234567890]") == [
        1.7976931348623157e308,
        123456789012345678901234567890,
    ]


def _same(a, b) -> bool:
    """Equal values of equal types throughout (``1 == 1.0`` and ``0.0 == -0.0`` are not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def _outcome(parse, data: bytes):
    try:
        return "value", parse(data)
    except ValueError:
        return "error", None


#: numbers as agents and engines spell them, and worse: long mantissas, big exponents, -0
number_texts = st.from_regex(r"\A-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,3})?\Z", fullmatch=True)
texts_with_escapes = st.lists(
    st.sampled_from(["a", "é", "\\n", "\\u00e9", "\\ud83d\\ude00", "\\ud800", "\\udc00x", '\\"', "\x01", "\U0001f600"]),
    max_size=6,
).map("".join)
json_texts = st.recursive(
    number_texts | st.integers(-(2**80), 2**80).map(str) | st.floats().map(repr) | texts_with_escapes.map(lambda t: f'"{t}"') | st.sampled_from(["true", "false", "null", "NaN", "-Infinity"]),
    lambda inner: st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
    | st.lists(st.tuples(texts_with_escapes, inner), max_size=4).map(
        lambda kv: "{" + ", ".join(f'"{k}" : {v}' for k, v in kv) + "}"
    ),
    max_leaves=12,
)


@settings(max_examples=1500, deadline=None)
@given(json_texts.map(str.encode) | st.binary(max_size=40) | json_texts.map(lambda t: t.encode("utf-16")))
def test_loads_accepts_returns_and_refuses_exactly_what_json_does(data: bytes) -> None:
    """The orjson path is only faster: every text parses to the same value, of the same types, or
    is refused, as by ``json`` alone (``_json_loads``)."""
    got, expected = _outcome(strict_json.loads, data), _outcome(strict_json._json_loads, data)
    assert got[0] == expected[0] and _same(got[1], expected[1]), (data, got, expected)


def test_loads_falls_back_to_json_for_integers_orjson_reads_as_floats() -> None:
    import orjson

    text = b"[18446744073709551616, -9223372036854775809]"
    assert type(orjson.loads(text)[0]) is float  # the reason for the fallback
    assert strict_json.loads(text) == [2**64, -(2**63) - 1]
    assert all(type(v) is int for v in strict_json.loads(text))


def test_loads_refuses_and_explains_as_json_does() -> None:
    with pytest.raises(ValueError, match="Expecting value: line 1 column 2"):
        strict_json.loads(b"[,]")
