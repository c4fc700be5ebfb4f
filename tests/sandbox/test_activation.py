"""Activation: providers verify before use (fail closed, naming the plugin); the doctor reports."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.doctor import run_doctor
from miles_core.errors import ActivationError, PluginLoadError
from miles_core.sandbox.activation import open_provider
from miles_core.sandbox.base import SandboxProvider
from miles_core.sandbox.spec import SandboxProviderSpec
from miles_core.testing import plugin_module
from miles_core.testing.sandbox import InMemoryProvider

register_cpu_ci(est_time=2, suite="stage-a-cpu")


class MemorySpec(SandboxProviderSpec):
    name = "memory"

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.created = 0

    def create(self, config: Mapping[str, Any] | None = None) -> SandboxProvider:
        self.created += 1
        return InMemoryProvider()

    def verify(self) -> dict[str, Any]:
        if self.broken:
            raise RuntimeError("sdk lacks AsyncSandbox.create(template=...)")
        return {"ok": True}


def test_a_provider_failing_verification_is_never_created(miles_pm_factory) -> None:  # type: ignore[no-untyped-def]
    spec = MemorySpec(broken=True)
    pm = miles_pm_factory()
    pm.register(
        plugin_module("m", miles_sandbox_providers=lambda: [spec]),
        name="mem-plugin",
        distribution="mem-dist",
        version="9.1",
    )
    with pytest.raises(ActivationError) as raised:
        open_provider("memory", pm=pm)
    message = str(raised.value)
    for part in ("mem-plugin", "mem-dist 9.1", "sandbox 'memory'", "sdk lacks AsyncSandbox.create"):
        assert part in message
    assert spec.created == 0


def test_a_broken_plugin_blocks_sandbox_activation(miles_pm_factory) -> None:  # type: ignore[no-untyped-def]
    def boom() -> list[SandboxProviderSpec]:
        raise ImportError("e2b SDK missing")

    pm = miles_pm_factory()
    pm.register(plugin_module("ok", miles_sandbox_providers=lambda: [MemorySpec()]), name="good")
    pm.register(plugin_module("bad", miles_sandbox_providers=boom), name="bad")
    with pytest.raises(PluginLoadError, match="bad"):
        open_provider("memory", pm=pm)


def test_doctor_verifies_the_local_provider(miles_pm_factory, sandbox_root: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MILES_SANDBOX_ROOT", str(sandbox_root))
    pm = miles_pm_factory(builtins=True)
    spec = MemorySpec(broken=True)
    pm.register(plugin_module("m", miles_sandbox_providers=lambda: [spec]), name="mem-plugin")
    report = run_doctor(pm, concerns=("sandbox",))
    rows = {r.item: r for r in report.results}
    assert rows["local"].status == "ok" and rows["local"].data["interfaces_inside"]
    assert rows["memory"].status == "fail" and "sdk lacks" in rows["memory"].detail
    assert not report.ok
