"""Error types shared across the core. The CLI maps each to a message and an exit code."""

from __future__ import annotations

#: exit status of a command stopped by Ctrl-C (128 + SIGINT, what shells report)
INTERRUPTED = 130


class MilesError(Exception):
    """Base class for errors the CLI reports without a stack trace."""

    exit_code = 1


class ConfigError(MilesError):
    """Bad input: a setting, file or environment variable that fails validation."""

    exit_code = 2


class PluginLoadError(MilesError):
    """A plugin failed to import or register and ``MILES_PLUGIN_ERRORS=raise`` is set,
    or a command needed a plugin that is broken."""


class ActivationError(MilesError):
    """A registered object failed register -> apply -> verify. Fail closed.

    The message always names the plugin, its distribution and version, the object and the cause.
    """

    def __init__(
        self,
        *,
        plugin: str,
        distribution: str | None,
        version: str | None,
        obj: str,
        cause: str,
        concern: str | None = None,
    ) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.obj = obj
        self.cause = cause
        self.concern = concern
        where = f"{distribution or 'unknown distribution'} {version or '?'}"
        what = f"{concern} {obj!r}" if concern else repr(obj)
        super().__init__(f"plugin {plugin!r} ({where}): {what} failed verification: {cause}")
