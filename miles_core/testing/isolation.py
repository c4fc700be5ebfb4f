"""An isolated plugin manager: no entry-point autoload, plugins registered explicitly."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

from miles_core.plugins import ErrorPolicy, MilesPluginManager, set_plugin_manager


@contextlib.contextmanager
def isolated_plugin_manager(
    plugins: Iterable[tuple[str, ModuleType | object]] = (),
    *,
    allow: Iterable[str] | None = None,
    deny: Iterable[str] | None = None,
    errors: ErrorPolicy = "record",
    builtins: bool = False,
) -> Iterator[MilesPluginManager]:
    """Yield a fresh manager installed as the process-wide one, then restore the previous.

    ``plugins`` are ``(name, module)`` pairs registered in order. With ``builtins=True`` the core's
    own built-in plugins are registered first (as a real install would), without loading any
    third-party entry point.
    """
    pm = MilesPluginManager(allow=allow, deny=deny, errors=errors)
    if builtins:
        register_builtins(pm)
    for name, module in plugins:
        pm.register(module, name=name)
    previous = set_plugin_manager(pm)
    try:
        yield pm
    finally:
        set_plugin_manager(previous)


def register_builtins(pm: MilesPluginManager) -> None:
    """Register the core's built-in plugins, read from ``miles``' own entry points."""
    from importlib import metadata

    from miles_core import __version__
    from miles_core.hookspecs import ENTRY_POINT_GROUP
    from miles_core.plugins import CORE_DISTRIBUTION, import_object

    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.dist is not None and ep.dist.name == CORE_DISTRIBUTION:
            pm.register(
                import_object(ep.value),
                name=ep.name,
                distribution=CORE_DISTRIBUTION,
                version=__version__,
                builtin=True,
            )


def plugin_module(name: str, **hooks: Callable[..., object]) -> ModuleType:
    """Build an in-memory plugin module whose hook implementations are ``hooks``.

    ``plugin_module("demo", miles_tasks=lambda: [my_task])`` is equivalent to a module with an
    ``@hookimpl def miles_tasks(): return [my_task]``; register it with ``pm.register(...)``.
    """
    from miles_core.hookspecs import hookimpl

    module = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        fn.__name__ = hook_name
        setattr(module, hook_name, hookimpl(fn))
    return module
