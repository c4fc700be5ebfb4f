"""Test support for miles and for third-party plugin authors.

Installed as a pytest plugin (entry point ``pytest11``), so its fixtures are available in any
project that has miles installed:

* ``miles_pm`` -- an isolated :class:`~miles_core.plugins.MilesPluginManager` with entry-point
  autoload blocked, installed as the process-wide manager for the test's duration. Register the
  plugins under test with ``miles_pm.register(module, name=...)``.
* ``miles_pm_factory`` -- build further isolated managers (for allow/deny-list tests).
* :func:`plugin_module` -- an in-memory plugin module from hook functions.

Per-concern conformance kits live in the submodules of this package.
"""

from miles_core.testing.isolation import isolated_plugin_manager, plugin_module

__all__ = ["isolated_plugin_manager", "plugin_module"]
