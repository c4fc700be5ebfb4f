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
