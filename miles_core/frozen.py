"""Frozen dataclasses that are cheap to construct.

A frozen dataclass's generated ``__init__`` sets every field through ``object.__setattr__`` (its
own ``__setattr__`` refuses), ~0.3 us a field -- three times what a plain class pays. The session
service and the rollouts build thousands of such objects a step (turns, samples, trajectories,
completions, ~10 fields each). :func:`quick_init` gives a frozen dataclass an ``__init__`` with
the same signature that writes the fields into the new instance's ``__dict__`` directly -- what
``object.__setattr__`` does for a plain attribute -- and then calls ``__post_init__`` as the
generated one would. Everything else (equality, hashing, ``repr``, refused assignment,
``dataclasses.replace``, pickling) stays the dataclass's own; the generated ``__init__`` is kept
as ``__dataclass_init__`` (the tests compare the two).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_FACTORY = object()  # "not passed" for a field with a default factory


def quick_init(cls: type[T]) -> type[T]:
    """Replace the ``__init__`` of the frozen dataclass ``cls`` (see the module doc)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"{cls.__name__} is not a frozen dataclass")
    if "__slots__" in cls.__dict__:
        raise TypeError(f"{cls.__name__} has __slots__: its instances have no __dict__ to fill")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if len(fields) != len(cls.__dataclass_fields__):  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} has InitVar or ClassVar pseudo-fields, which quick_init does not handle")
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY}
    positional: list[str] = []
    keyword: list[str] = []
    lines: list[str] = []
    for f in fields:
        name = f.name
        has_default = f.default is not dataclasses.MISSING
        has_factory = f.default_factory is not dataclasses.MISSING
        if has_default:
            namespace[f"_default_{name}"] = f.default
        if has_factory:
            namespace[f"_factory_{name}"] = f.default_factory
        if f.init:
            if has_default:
                param = f"{name}=_default_{name}"
            elif has_factory:
                param = f"{name}=_FACTORY"
            else:
                param = name
            (keyword if f.kw_only else positional).append(param)
            value = f"_factory_{name}() if {name} is _FACTORY else {name}" if has_factory else name
        elif has_default:
            value = f"_default_{name}"
        elif has_factory:
            value = f"_factory_{name}()"
        else:
            continue  # set by __post_init__
        lines.append(f"    d[{name!r}] = {value}")
    if hasattr(cls, "__post_init__"):
        lines.append("    self.__post_init__()")
    signature = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({signature}) -> None:\n    d = self.__dict__\n" + "\n".join(lines) + "\n"
    exec(source, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__dataclass_init__ = cls.__init__  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
