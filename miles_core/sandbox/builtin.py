"""Built-in plugin ``core-sandbox``: contributes the ``local`` sandbox provider.

Importing this module and calling its hook stays cheap: the provider itself is imported in
:meth:`LocalProviderSpec.create` and :meth:`LocalProviderSpec.verify`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.errors import ConfigError
from miles_core.hookspecs import hookimpl
from miles_core.sandbox.spec import SandboxProviderSpec, check_options

if TYPE_CHECKING:
    from miles_core.sandbox.base import SandboxProvider


class LocalProviderSpec(SandboxProviderSpec):
    name = "local"
    default_base = "host"
    description = (
        "Sandboxes on this host: Linux namespaces (bwrap or unshare) or processes; limits, TTL watchdog."
    )
    options: ClassVar[dict[str, str]] = {
        "root": "state directory (default $MILES_SANDBOX_ROOT or $TMPDIR/miles-sandbox-<uid>)",
        "isolation": "namespaces or process; default: namespaces where the host supports them",
        "namespace_tool": "auto (bwrap if installed and working, else unshare), bwrap or unshare",
        "tmpfs_mb": "size of each private /tmp, /var/tmp and /dev/shm in MB (namespaces; default 256)",
        "cgroup": "namespaces: cgroup v2 parent for per-sandbox limits: a path, none, or auto (default: "
        "$MILES_SANDBOX_CGROUP, else as root the v2 root's miles-sandbox; else rlimits)",
        "isolate_network": "process isolation: true/false; default: when the host permits network namespaces",
        "step_timeout_s": "seconds one image build step may run (default 1800)",
    }

    @property
    def default_build_user(self) -> str:
        """Local build steps run as this process's user."""
        import getpass

        return getpass.getuser()

    def check_config(self, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        cfg = check_options(self.name, config, self.options)
        if "isolate_network" in cfg:
            cfg["isolate_network"] = _boolean(cfg["isolate_network"], "isolate_network")
        if "step_timeout_s" in cfg:
            cfg["step_timeout_s"] = _positive(cfg["step_timeout_s"], "step_timeout_s")
        if "tmpfs_mb" in cfg:
            cfg["tmpfs_mb"] = int(_positive(cfg["tmpfs_mb"], "tmpfs_mb", unit="megabytes"))
        for key, allowed in (("isolation", ("namespaces", "process")), ("namespace_tool", ("auto", "bwrap", "unshare"))):
            if key in cfg and cfg[key] not in allowed:
                raise ConfigError(
                    f"local provider option {key}: expected one of {', '.join(allowed)}, got {cfg[key]!r}"
                )
        if cfg.get("isolation") == "namespaces" and cfg.get("isolate_network") is False:
            raise ConfigError(
                "local provider options isolation=namespaces and isolate_network=false contradict: a namespace "
                "sandbox has its own network unless created with network=True"
            )
        return cfg

    def create(self, config: Mapping[str, Any] | None = None) -> SandboxProvider:
        cfg = self.check_config(config)
        from miles_core.sandbox.local.provider import LocalProvider

        return LocalProvider(**cfg)

    def verify(self) -> dict[str, Any]:
        from miles_core.sandbox.local.probe import probe

        return probe()


def _boolean(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"local provider option {key}: expected true or false, got {value!r}")


def _positive(value: Any, key: str, unit: str = "seconds") -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if not number > 0:
        raise ConfigError(f"local provider option {key}: expected a positive number of {unit}, got {value!r}")
    return number


@hookimpl
def miles_sandbox_providers() -> list[SandboxProviderSpec]:
    return [LocalProviderSpec()]
