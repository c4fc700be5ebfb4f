"""Strict JSON for bytes that cross HTTP (session server requests and replies, engine calls).

Python's ``json`` accepts ``NaN``/``Infinity`` and unpaired UTF-16 surrogate escapes
(``"\\ud800"``); neither survives being encoded again as UTF-8 JSON, so both are refused here,
where the bytes come in, instead of failing later deep inside a tokenizer or an encoder.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def loads(data: bytes) -> Any:
    """``json.loads`` that raises ``ValueError`` for NaN/Infinity, unpaired surrogates and
    nesting too deep to handle."""
    try:
        value = json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if _SURROGATE_ESCAPE.search(data):  # cheap pre-filter: the full check is rarely needed
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("JSON string contains an unpaired UTF-16 surrogate escape") from None
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON value")


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON; raises ``ValueError`` for NaN/Infinity, which :func:`loads` refuses too."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
