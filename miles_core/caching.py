"""Small caches for hot paths: a size-bounded map, and keys that are exact JSON.

:func:`exact_json_key` turns a value made only of JSON's own types into bytes such that equal
bytes mean equal values of equal types (``1``, ``1.0`` and ``true`` apart; no tuple passing for
a list), so whatever was computed from one value -- a validation, a rendering -- holds for any
value with the same key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import orjson

V = TypeVar("V")

_SCALARS = frozenset({str, int, float, bool, type(None)})


def exact_json_key(value: Any) -> bytes | None:
    """``value`` as JSON bytes if it is made only of ``str``, ``int``, ``float``, ``bool``,
    ``None``, ``list`` and ``dict`` with string keys (no subclasses, no tuples); else ``None``,
    as for what orjson cannot encode (integers beyond 64 bits, nesting deeper than 254)."""
    if not is_exact_json(value):
        return None
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError
        return None


def is_exact_json(value: Any) -> bool:
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is dict:
        for k, v in value.items():
            if type(k) is not str or (type(v) not in _SCALARS and not is_exact_json(v)):
                return False
        return True
    if kind is list:
        for v in value:  # noqa: SIM110  (a loop: all() over a generator costs twice as much here)
            if type(v) not in _SCALARS and not is_exact_json(v):
                return False
        return True
    return False


class BoundedCache(Generic[V]):
    """Values by key, the oldest evicted once their total ``size`` exceeds ``limit``."""

    def __init__(self, limit: int, *, size: Callable[[V], int]) -> None:
        self._limit = limit
        self._size = size
        self._total = 0
        self._entries: dict[Hashable, V] = {}

    def get_or_compute(self, key: Hashable, compute: Callable[[], V]) -> V:
        value = self._entries.get(key)
        if value is None:
            value = compute()
            self.put(key, value)
        return value

    def get(self, key: Hashable) -> V | None:
        return self._entries.get(key)

    def put(self, key: Hashable, value: V) -> None:
        if key in self._entries:
            return
        self._entries[key] = value
        self._total += self._size(value)
        while self._total > self._limit:
            self._total -= self._size(self._entries.pop(next(iter(self._entries))))
