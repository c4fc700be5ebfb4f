"""The descriptor a plugin's ``miles_sandbox_providers()`` hook returns.

Kept apart from :mod:`miles_core.sandbox.base` so registering a provider imports nothing but
this module: discovery (``miles plugins list``) must stay fast.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.errors import ConfigError

if TYPE_CHECKING:
    from miles_core.sandbox.base import SandboxProvider


class SandboxProviderSpec(ABC):
    """What ``miles_sandbox_providers()`` returns: a cheap descriptor of one provider.

    ``options`` documents the config keys :meth:`create` accepts (shown by
    ``miles sandbox providers``); ``default_base`` and ``default_build_user`` are the base image
    and build user a recipe gets when the caller names none (``miles sandbox run --step``). :meth:`create` does the heavy imports and validates ``config``,
    raising :class:`~miles_core.errors.ConfigError` that names the offending key.
    :meth:`verify` proves the provider's effect/surface (the SDK calls it makes exist with the
    signatures it uses; the local isolation primitives work) and returns facts for reports.
    """

    name: str
    description: str = ""
    default_base: str = ""
    options: ClassVar[Mapping[str, str]] = {}

    @property
    def default_build_user(self) -> str:
        """The user a recipe's build steps run as when it names none (a subclass may override it
        with a class attribute or a property)."""
        return "root"

    def check_config(self, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Validate ``config`` without creating anything (cheap: no SDK import); returns it
        normalised. Raises :class:`~miles_core.errors.ConfigError` naming the offending key.
        ``miles train`` calls it when its config is built, so bad options fail before any work."""
        return check_options(self.name, config, self.options)

    @abstractmethod
    def create(self, config: Mapping[str, Any] | None = None) -> SandboxProvider: ...

    @abstractmethod
    def verify(self) -> dict[str, Any]: ...


def check_options(name: str, config: Mapping[str, Any] | None, options: Mapping[str, str]) -> dict[str, Any]:
    """``config`` as a dict, rejecting keys the provider does not document."""
    config = dict(config or {})
    unknown = sorted(set(config) - set(options))
    if unknown:
        raise ConfigError(
            f"sandbox provider {name!r}: unknown option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(options)) or 'none'}"
        )
    return config
