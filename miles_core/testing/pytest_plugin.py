"""pytest plugin (entry point ``pytest11``): fixtures for testing against miles."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from typing import ParamSpec, TypeVar

import pytest

from miles_core.plugins import MilesPluginManager
from miles_core.testing.isolation import isolated_plugin_manager

P = ParamSpec("P")
T = TypeVar("T")


@pytest.fixture
def miles_pm() -> Iterator[MilesPluginManager]:
    """An empty, isolated plugin manager installed as the process-wide one for this test."""
    with isolated_plugin_manager() as pm:
        yield pm


def _entering(stack: ExitStack, context: Callable[P, AbstractContextManager[T]]) -> Callable[P, T]:
    """``context(...)`` entered on ``stack``: what the ``with`` would bind, exited with the stack."""

    def enter(*args: P.args, **kwargs: P.kwargs) -> T:
        return stack.enter_context(context(*args, **kwargs))

    return enter


@pytest.fixture
def miles_pm_factory() -> Iterator[Callable[..., MilesPluginManager]]:
    """Build isolated managers: ``miles_pm_factory(plugins=[(name, module)], allow=..., deny=...,
    builtins=True)``. The last one built is the process-wide manager until the test ends."""
    with ExitStack() as stack:
        yield _entering(stack, isolated_plugin_manager)
