"""pytest plugin (entry point ``pytest11``): fixtures for testing against miles."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from miles_core.plugins import MilesPluginManager
from miles_core.testing.isolation import isolated_plugin_manager


@pytest.fixture
def miles_pm() -> Iterator[MilesPluginManager]:
    """An empty, isolated plugin manager installed as the process-wide one for this test."""
    with isolated_plugin_manager() as pm:
        yield pm


@pytest.fixture
def miles_pm_factory() -> Iterator[Callable[..., MilesPluginManager]]:
    """Build isolated managers: ``miles_pm_factory(plugins=[(name, module)], allow=..., deny=...,
    builtins=True)``. The last one built is the process-wide manager until the test ends."""
    with ExitStack() as stack:

        def make(**kwargs: object) -> MilesPluginManager:
            return stack.enter_context(isolated_plugin_manager(**kwargs))  # type: ignore[arg-type]

        yield make
