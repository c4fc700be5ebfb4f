"""Activating a sandbox provider by name: discover, verify (fail closed), create."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from miles_core.plugins import Contribution, MilesPluginManager, get_plugin_manager
from miles_core.sandbox.base import SandboxProvider, SandboxProviderSpec
from miles_core.sandbox.lifecycle import SandboxManager

DEFAULT_PROVIDER = "local"
_VERIFIED_ATTR = "_miles_verified"


def provider_contribution(name: str, pm: MilesPluginManager | None = None) -> Contribution:
    """The contribution named ``name``; raises if it, or a plugin that may provide it, is broken."""
    return (pm or get_plugin_manager()).contribution("sandbox", name)


def verify_contribution(contribution: Contribution, pm: MilesPluginManager) -> dict[str, Any]:
    """The provider's ``verify()`` facts, computed once per descriptor.

    A failed verification raises :class:`~miles_core.errors.ActivationError` naming the plugin,
    its distribution and version, the provider and the cause.
    """
    spec: SandboxProviderSpec = contribution.obj
    facts = getattr(spec, _VERIFIED_ATTR, None)
    if facts is None:
        facts = pm.verify(contribution, spec.verify)
        setattr(spec, _VERIFIED_ATTR, facts)
    return facts


def verified_spec(
    name: str, pm: MilesPluginManager | None = None
) -> tuple[SandboxProviderSpec, dict[str, Any]]:
    """The descriptor named ``name`` and its verify facts (fails closed, see above)."""
    pm = pm or get_plugin_manager()
    contribution = provider_contribution(name, pm)
    return contribution.obj, verify_contribution(contribution, pm)


def open_provider(
    name: str = DEFAULT_PROVIDER,
    config: Mapping[str, Any] | None = None,
    pm: MilesPluginManager | None = None,
) -> SandboxProvider:
    """A verified provider instance, configured by ``config`` (close it with ``aclose()``)."""
    spec, _ = verified_spec(name, pm)
    return spec.create(config)


@asynccontextmanager
async def open_manager(
    name: str = DEFAULT_PROVIDER,
    config: Mapping[str, Any] | None = None,
    pm: MilesPluginManager | None = None,
    **manager_options: Any,
) -> AsyncIterator[SandboxManager]:
    """A :class:`SandboxManager` over a fresh provider; leaving destroys its sandboxes and closes both."""
    provider = open_provider(name, config, pm)
    try:
        async with SandboxManager(provider, **manager_options) as manager:
            yield manager
    finally:
        await provider.aclose()
