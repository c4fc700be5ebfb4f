"""Registration module of miles-e2b (entry point ``miles-e2b`` in group ``miles.plugins``).

Importing this module must stay cheap: no torch, transformers, ray, megatron or e2b at import.
The SDK is imported by :meth:`E2BProviderSpec.create` and :meth:`E2BProviderSpec.verify`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.hookspecs import hookimpl
from miles_core.sandbox.spec import SandboxProviderSpec
from miles_e2b.options import OPTIONS

if TYPE_CHECKING:
    from miles_core.sandbox.base import SandboxProvider


class E2BProviderSpec(SandboxProviderSpec):
    name = "e2b"
    description = "E2B Cloud or self-hosted AgentENV microVMs (preset=agentenv), through the async e2b SDK."
    default_base = "e2bdev/base"
    options: ClassVar[dict[str, str]] = OPTIONS

    def check_config(self, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every option validated (endpoints, domain, preset, the key *reference*) without the SDK."""
        from miles_e2b.config import E2BConfig

        E2BConfig.from_options(config)
        return dict(config or {})

    def create(self, config: Mapping[str, Any] | None = None) -> SandboxProvider:
        from miles_e2b.config import E2BConfig
        from miles_e2b.provider import E2BProvider

        return E2BProvider(E2BConfig.from_options(config))

    def verify(self) -> dict[str, Any]:
        """The installed SDK has every call the provider makes, with the parameters it passes."""
        from miles_e2b import sdk

        return sdk.check_surface(sdk.load())


@hookimpl
def miles_sandbox_providers() -> list[SandboxProviderSpec]:
    return [E2BProviderSpec()]
