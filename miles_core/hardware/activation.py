"""Activate the hardware concern once per process: select, apply fixes, verify (fail closed)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_core.errors import ActivationError, ConfigError
from miles_core.hardware.base import (
    ENV_OVERRIDE,
    WORKER_ROLES,
    CheckpointIOPolicy,
    FixReport,
    HardwareBackend,
)
from miles_core.hardware.selection import Selection, select_backend
from miles_core.plugins import MilesPluginManager, get_plugin_manager

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ActiveHardware:
    """The selected, applied and verified backend of this process.

    ``fixes`` are those applied at activation; :meth:`prepare` adds a library's fixes to
    :attr:`prepared` on its first use.
    """

    selection: Selection
    fixes: tuple[FixReport, ...]
    pm: MilesPluginManager = field(repr=False, compare=False)
    prepared: dict[str, tuple[FixReport, ...]] = field(default_factory=dict, compare=False)

    @property
    def backend(self) -> HardwareBackend:
        return self.selection.backend

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def device(self) -> torch.device:
        """The ``torch.device`` to compute on (the current device index is the caller's)."""
        import torch

        return torch.device(self.backend.device_type)

    @property
    def distributed_backend(self) -> str:
        return self.backend.distributed_backend

    @property
    def checkpoint_io(self) -> CheckpointIOPolicy:
        return self.backend.checkpoint_io

    def worker_env(self, role: str) -> dict[str, str]:
        """Environment for a Ray worker of ``role`` (``runtime_env={"env_vars": ...}``)."""
        return self.backend.worker_env(role)

    def supports(self, capability: str) -> bool:
        return self.backend.supports(capability)

    def prepare(self, library: str) -> tuple[FixReport, ...]:
        """Apply and verify the fixes ``library`` needs here, once per process (see
        :meth:`HardwareBackend.prepare`); call it right before the library's first use.

        Fails closed like activation: an :class:`~miles_core.errors.ActivationError` names the
        backend's plugin and the cause.
        """
        with _lock:
            if library not in self.prepared:
                self.prepared[library] = tuple(
                    self.pm.verify(self.selection.contribution, self.backend.prepare, library)
                )
            return self.prepared[library]

    def all_fixes(self) -> tuple[FixReport, ...]:
        """Activation's fixes, then those of every library prepared so far."""
        return self.fixes + tuple(f for fixes in self.prepared.values() for f in fixes)

    def fix(self, name: str) -> FixReport:
        """The report of the fix called ``name`` (``KeyError`` if none was applied)."""
        for report in self.all_fixes():
            if report.name == name:
                return report
        raise KeyError(f"hardware backend {self.name!r} has applied no fix named {name!r}")

    def summary(self) -> dict[str, Any]:
        """Which backend ran, whose it is, how it was chosen and which built-ins it replaced
        (what a run's ``summary.json`` records)."""
        plugin = self.selection.contribution.plugin
        return {
            "backend": self.name,
            "plugin": plugin.name,
            "distribution": plugin.distribution,
            "version": plugin.version,
            "builtin": plugin.builtin,
            "selected_by": self.selection.selected_by,
            "reason": self.selection.reason,
            "replaces": [c.contribution.name for c in self.selection.replaced],
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.summary(),
            "device_type": self.backend.device_type,
            "device_count": self.backend.device_count(),
            "distributed_backend": self.distributed_backend,
            "visible_devices_env": self.backend.visible_devices_env,
            "capabilities": sorted(self.backend.capabilities),
            "checkpoint_io": {"d2h_copy": self.checkpoint_io.d2h_copy, "reason": self.checkpoint_io.reason},
            "fixes": {f.name: {"status": f.status, "detail": f.detail} for f in self.all_fixes()},
            "prepared_libraries": sorted(self.prepared),
            "worker_env": {role: self.worker_env(role) for role in WORKER_ROLES},
            "ci_hardware": self.backend.ci_hardware,
        }


@dataclass(frozen=True)
class _Cached:
    pm: MilesPluginManager
    override: str | None
    hardware: ActiveHardware


_lock = threading.RLock()
_cached: _Cached | None = None


def activate(pm: MilesPluginManager | None = None) -> ActiveHardware:
    """Select this process's backend, apply its fixes and verify them; cached per process.

    A later call returns the cached result unless the plugin manager or ``MILES_HARDWARE``
    changed; then the previous backend's fixes are reverted before the new one is activated.
    Raises :class:`~miles_core.errors.ActivationError` (naming plugin, distribution, version,
    backend and cause) if the backend cannot prove its fixes are in effect; with exit status 2
    (a config error's) when ``MILES_HARDWARE`` forced that backend.
    """
    global _cached
    pm = pm if pm is not None else get_plugin_manager()
    override = os.environ.get(ENV_OVERRIDE)
    with _lock:
        if _cached is not None and _cached.pm is pm and _cached.override == override:
            return _cached.hardware
        selection = select_backend(pm)
        if _cached is not None:
            _cached.hardware.backend.revert()
            _cached = None
        backend = selection.backend

        def establish() -> tuple[FixReport, ...]:
            try:
                fixes = tuple(backend.apply())
                backend.verify()
            except BaseException:
                backend.revert()
                raise
            return fixes

        try:
            fixes = pm.verify(selection.contribution, establish)
        except ActivationError as exc:
            if selection.selected_by == "override":
                # forced by MILES_HARDWARE onto a machine it cannot run on: bad input (the message names
                # the variable), not a broken plugin
                exc.exit_code = ConfigError.exit_code
            raise
        hardware = ActiveHardware(selection, fixes, pm)
        _cached = _Cached(pm, override, hardware)
        return hardware


def reset() -> None:
    """Revert the active backend's fixes and forget it (tests, and code that embeds miles)."""
    global _cached
    with _lock:
        if _cached is not None:
            _cached.hardware.backend.revert()
            _cached = None
