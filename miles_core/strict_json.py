"""Strict JSON for bytes that cross HTTP (session server requests and replies, engine calls).

Python's ``json`` accepts ``NaN``/``Infinity``, numbers too large for a float (``1e400`` parses
as infinity) and unpaired UTF-16 surrogate escapes (``"\\ud800"``); none survives being encoded
again as UTF-8 JSON, so all are refused here, where the bytes come in, instead of failing later
deep inside a tokenizer or an encoder. What :func:`loads` returns, :func:`dumps` can encode.

Both directions use orjson, with ``json`` behind it. orjson refuses everything :func:`loads`
refuses and parses 3-6x faster (a 20-turn chat request: 15 -> 6 us; an engine reply with
log-probs: 24 -> 4 us; the session server parses one of each per turn), but reads integers beyond
64 bits as floats: a text with a run of 19 or more digits, and any text orjson refuses, is
parsed by ``json`` instead, so what is accepted, the values returned and the errors raised are
``json``'s. Encoding: token ids and log-prob lists dominate what the session server writes, and
``json`` takes ~2 ms for a 32k-token prompt where orjson takes 0.25.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
#: a number orjson may not read exactly: 2**63 has 19 digits (a float's digits past the 17th
#: change nothing, but they cannot be told from an integer's here)
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def loads(data: bytes) -> Any:
    """``json.loads`` that raises ``ValueError`` for NaN/Infinity, numbers out of a float's
    range, unpaired surrogates and nesting too deep to handle."""
    if not _LONG_DIGITS.search(data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # json decides, and says why
    return _json_loads(data)


def _json_loads(data: bytes) -> Any:
    """:func:`loads` by ``json`` alone."""
    try:
        value = json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if _SURROGATE_ESCAPE.search(data):  # cheap pre-filter: the full check is rarely needed
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("JSON string contains an unpaired UTF-16 surrogate escape") from None
    return value


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON of a value :func:`loads` returned or that was built from such values.

    The bytes are those of ``json.dumps(value, separators=(",", ":"), ensure_ascii=False)``,
    except that floats that need an exponent may spell it differently (``1e-05`` as
    ``0.00001``, ``2.5e-08`` as ``2.5e-8``; the same number) and NaN and infinities, which
    :func:`loads` never returns, are written as ``null``. Raises ``ValueError`` for nesting too
    deep to encode.
    """
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: an integer beyond 64 bits, nesting deeper than 254
        pass
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except RecursionError:
        raise ValueError("JSON nested too deeply to encode") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON value")


def _finite_float(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"number {text[:32]} is out of range for a float")
    return number
