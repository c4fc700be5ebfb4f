"""The functions a transformers modeling module defines, read beneath the objects its names are bound to.

transformers decorates its kernel functions (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``,
...), so the module-level name is not always the function its file defines:

* ``use_kernel_func_from_hub_with_fallback`` wraps the function with :func:`functools.wraps` (the
  wrapper may call fla's kernel instead, whatever the device in some releases): ``__wrapped__``
  leads back to it;
* when the ``kernels`` package is importable in the range a release accepts (every install of
  transformers >= 5.25, which requires it; optional before), ``use_kernel_forward_from_hub`` turns
  the function into an ``nn.Module`` *instance* whose class's ``forward`` calls it, so that
  ``kernels.kernelize`` can swap it per model. Nothing but that ``forward``'s closure refers to
  the function.

:func:`defined_function` finds the function through both, keyed on the structure of the objects
(a ``__wrapped__`` chain, a callable whose ``forward`` closes over it), not on version numbers;
:func:`global_names_reached` lists what a function reaches through the helpers of its own module
(a GDN layer's ``forward`` calls ``causal_conv1d_fn`` itself up to 5.24, through the module's
``causal_conv1d_forward`` from 5.25). Importing this module is cheap (no torch, no transformers).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from types import FunctionType
from typing import Any

#: how many wrapper objects :func:`defined_function` looks through before it gives up
_MAX_WRAPPERS = 16
#: how many helper calls deep :func:`global_names_reached` follows a function's calls
_MAX_HELPER_DEPTH = 4


def _beneath(obj: Any) -> Iterator[Any]:
    """The objects one wrapper layer below ``obj``."""
    wrapped = getattr(obj, "__wrapped__", None)
    if wrapped is not None:
        yield wrapped
    if not inspect.isfunction(obj) and callable(obj):
        # a function module of `kernels`: an instance whose class's forward closes over the function
        forward = getattr(type(obj), "forward", None)
        if inspect.isfunction(forward):
            yield from inspect.getclosurevars(forward).nonlocals.values()


def defined_function(obj: Any, name: str) -> FunctionType | None:
    """The function whose ``def`` is named ``name`` that ``obj`` is or wraps (see the module
    docstring for the wrappers looked through), or ``None`` if ``obj`` hides no such function."""
    pending: list[Any] = [obj]
    seen: set[int] = set()
    while pending and len(seen) < _MAX_WRAPPERS:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, FunctionType) and current.__code__.co_name == name:
            return current
        pending.extend(_beneath(current))
    return None


def global_names_reached(function: FunctionType, depth: int = _MAX_HELPER_DEPTH) -> frozenset[str]:
    """The names ``function``'s code uses (globals and attribute names alike, as ``co_names`` lists
    them), with those of every function of the same module it calls by a global name (looked up
    beneath transformers' wrappers), ``depth`` calls deep.

    Reading code, not running it: a name counts as reached where the function may call it."""
    namespace: Mapping[str, Any] = function.__globals__
    reached: set[str] = set()
    visited: set[int] = set()
    frontier = [function]
    for _ in range(depth + 1):
        calls = []
        for fn in frontier:
            if id(fn.__code__) in visited:
                continue
            visited.add(id(fn.__code__))
            reached.update(fn.__code__.co_names)
            for name in fn.__code__.co_names:
                if name not in namespace:
                    continue
                helper = defined_function(namespace[name], name)
                if helper is not None and helper.__globals__ is namespace:
                    calls.append(helper)
        frontier = calls
    return frozenset(reached)
