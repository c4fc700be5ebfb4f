"""Selection and activation semantics, with fake backends (no torch needed for these rules)."""

from __future__ import annotations

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ActivationError, ConfigError, PluginLoadError
from miles_core.hardware import (
    CheckpointIOPolicy,
    Detection,
    FixReport,
    HardwareBackend,
    SelectionError,
    activate,
    select_backend,
)
from miles_core.hookspecs import hookimpl

register_cpu_ci(est_time=2, suite="stage-a-cpu")


class FakeBackend(HardwareBackend):
    device_type = "meta"
    distributed_backend = "fake"
    visible_devices_env = "FAKE_VISIBLE_DEVICES"
    ray_noset_envs = ("RAY_EXPERIMENTAL_NOSET_FAKE_VISIBLE_DEVICES",)
    capabilities = frozenset({"triton"})
    ci_hardware = "fake"
    checkpoint_io = CheckpointIOPolicy("pageable-blocking", "fake")

    def __init__(self, name: str, claims: bool = True, verify_error: str | None = None) -> None:
        self.name = name
        self.claims = claims
        self.verify_error = verify_error
        self.applied = 0
        self.reverted = 0

    def detect(self) -> Detection:
        return Detection(self.claims, f"{self.name} {'claims' if self.claims else 'declines'} (fake)")

    def device_count(self) -> int:
        return 1

    def apply(self) -> list[FixReport]:
        self.applied += 1
        return [FixReport(f"{self.name}-fix", "applied", "fake fix")]

    def revert(self) -> None:
        self.reverted += 1

    def verify(self) -> None:
        super().verify()
        if self.verify_error:
            raise RuntimeError(self.verify_error)


class FakePlugin:
    def __init__(self, *backends: HardwareBackend) -> None:
        self.backends = list(backends)

    @hookimpl
    def miles_hardware_backends(self) -> list[HardwareBackend]:
        return self.backends


def manager(miles_pm_factory, builtin: list[HardwareBackend] = (), **plugins: list[HardwareBackend]):
    pm = miles_pm_factory()
    if builtin:
        pm.register(
            FakePlugin(*builtin), name="core-fake", distribution="miles", version="0.1.0", builtin=True
        )
    for name, backends in plugins.items():
        pm.register(FakePlugin(*backends), name=name, distribution=f"dist-{name}", version="9.9")
    return pm


def test_the_single_claiming_backend_is_selected_with_its_reason(miles_pm_factory) -> None:
    pm = manager(miles_pm_factory, builtin=[FakeBackend("a", claims=False), FakeBackend("b")])
    selection = select_backend(pm, environ={})
    assert selection.backend.name == "b"
    assert selection.selected_by == "detection"
    assert selection.reason == "b claims (fake)"
    assert [c.detection.claimed for c in selection.candidates] == [False, True]


def test_a_plugin_backend_beats_a_builtin_one(miles_pm_factory) -> None:
    pm = manager(miles_pm_factory, builtin=[FakeBackend("cpu")], p1=[FakeBackend("npu")])
    selection = select_backend(pm, environ={})
    assert selection.backend.name == "npu"
    assert "beats the built-in cpu" in selection.reason


def test_two_plugins_claiming_the_machine_is_an_error_naming_both(miles_pm_factory) -> None:
    pm = manager(miles_pm_factory, builtin=[FakeBackend("cpu")], p1=[FakeBackend("x")], p2=[FakeBackend("y")])
    with pytest.raises(SelectionError) as err:
        select_backend(pm, environ={})
    message = str(err.value)
    assert "'x' (plugin 'p1' (dist-p1 9.9))" in message
    assert "'y' (plugin 'p2' (dist-p2 9.9))" in message
    assert "MILES_HARDWARE" in message


def test_two_builtins_claiming_the_machine_is_an_error_too(miles_pm_factory) -> None:
    pm = manager(miles_pm_factory, builtin=[FakeBackend("a"), FakeBackend("b")])
    with pytest.raises(SelectionError, match="more than one hardware backend claims"):
        select_backend(pm, environ={})


def test_override_selects_a_backend_detection_declines(miles_pm_factory) -> None:
    pm = manager(miles_pm_factory, builtin=[FakeBackend("cpu")], p1=[FakeBackend("x", claims=False)])
    selection = select_backend(pm, environ={"MILES_HARDWARE": "x"})
    assert selection.backend.name == "x"
    assert selection.selected_by == "override"
    assert selection.reason == "MILES_HARDWARE=x (detection: x declines (fake))"


def test_override_resolves_two_competing_claims(miles_pm_factory) -> None:
    pm = manager(miles_pm_factory, p1=[FakeBackend("x")], p2=[FakeBackend("y")])
    assert select_backend(pm, environ={"MILES_HARDWARE": "y"}).backend.name == "y"


def test_unknown_override_is_a_config_error_listing_the_registered_names(miles_pm_factory) -> None:
    pm = manager(miles_pm_factory, builtin=[FakeBackend("cpu")], p1=[FakeBackend("x")])
    with pytest.raises(
        ConfigError, match=r"MILES_HARDWARE='tpu' names no registered hardware backend \(registered: cpu, x\)"
    ):
        select_backend(pm, environ={"MILES_HARDWARE": "tpu"})


def test_no_claim_is_an_error_with_every_reason(miles_pm_factory) -> None:
    pm = manager(
        miles_pm_factory, builtin=[FakeBackend("a", claims=False)], p1=[FakeBackend("x", claims=False)]
    )
    with pytest.raises(
        SelectionError, match=r"no hardware backend claims this machine: 'a'.*a declines.*'x'.*x declines"
    ):
        select_backend(pm, environ={})


def test_a_detect_that_raises_names_the_backend_and_plugin(miles_pm_factory) -> None:
    broken = FakeBackend("x")
    broken.detect = lambda: 1 / 0  # type: ignore[method-assign]
    pm = manager(miles_pm_factory, builtin=[FakeBackend("cpu")], p1=[broken])
    with pytest.raises(SelectionError, match=r"'x' of plugin 'p1' .*ZeroDivisionError"):
        select_backend(pm, environ={})


def test_a_broken_plugin_fails_activation_closed(miles_pm_factory) -> None:
    class Broken:
        @hookimpl
        def miles_hardware_backends(self):
            raise RuntimeError("cannot load driver bindings")

    pm = manager(miles_pm_factory, builtin=[FakeBackend("cpu")])
    pm.register(Broken(), name="broken-hw")
    with pytest.raises(PluginLoadError, match=r"broken-hw.*cannot load driver bindings"):
        activate(pm)


def test_activation_applies_then_verifies_and_is_cached(miles_pm_factory) -> None:
    backend = FakeBackend("x")
    pm = manager(miles_pm_factory, builtin=[FakeBackend("cpu", claims=False)], p1=[backend])
    hardware = activate(pm)
    assert activate(pm) is hardware
    assert backend.applied == 1
    assert hardware.fix("x-fix").status == "applied"
    assert hardware.to_dict()["worker_env"]["train"] == {
        "MILES_HARDWARE": "x",
        "RAY_EXPERIMENTAL_NOSET_FAKE_VISIBLE_DEVICES": "1",
    }
    assert hardware.supports("triton") and not hardware.supports("nvml")


def test_changing_the_override_reverts_the_previous_backend(miles_pm_factory, monkeypatch) -> None:
    cpu, x = FakeBackend("cpu"), FakeBackend("x", claims=False)
    pm = manager(miles_pm_factory, builtin=[cpu], p1=[x])
    assert activate(pm).name == "cpu"
    monkeypatch.setenv("MILES_HARDWARE", "x")
    assert activate(pm).name == "x"
    assert (cpu.reverted, x.applied) == (1, 1)


def test_failed_verification_names_plugin_distribution_version_and_cause(miles_pm_factory) -> None:
    backend = FakeBackend("x", verify_error="guard missing on Writer")
    pm = manager(miles_pm_factory, p1=[backend])
    with pytest.raises(ActivationError) as err:
        activate(pm)
    assert (err.value.plugin, err.value.distribution, err.value.version, err.value.obj) == (
        "p1",
        "dist-p1",
        "9.9",
        "x",
    )
    assert "guard missing on Writer" in str(err.value)
    assert err.value.exit_code == 1  # selected by detection: the plugin failed, not the input
    assert backend.reverted == 1, "a backend that fails verification must not leave its fixes behind"
