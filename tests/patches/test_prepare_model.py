"""prepare_model: apply -> verify -> probe per matching patch, failures with provenance, the report."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ActivationError, PluginLoadError
from miles_core.patches import KernelRequirement, prepare_model
from miles_core.plugins import MilesPluginManager
from miles_core.testing import plugin_module

register_cpu_ci(est_time=4, suite="stage-a-cpu")


def register(pm: MilesPluginManager, *patches: object) -> None:
    pm.register(
        plugin_module("toy", miles_model_patches=lambda: list(patches)),
        name="toy-plugin",
        distribution="toy-dist",
        version="9.9",
    )


def test_report_names_each_patch_and_its_classes(miles_pm: MilesPluginManager, toy: SimpleNamespace) -> None:
    register(
        miles_pm, toy.Patch(toy.layer), toy.Patch(toy.make_layer("Absent"), name="declines", match=False)
    )
    report = prepare_model(toy.Model(toy.layer))
    entry = report["toy-patch"]
    assert entry.classes == (f"{toy.layer.__module__}.ToyMixer",)
    assert (entry.plugin, entry.distribution, entry.version) == ("toy-plugin", "toy-dist", "9.9")
    assert entry.probe is not None and entry.probe.passed
    assert report.not_matched == ("declines",) and "declines" not in report
    assert report.packing_scope
    data = json.loads(json.dumps(report.to_dict()))
    assert data["patches"][0]["groups"] == {"toy": list(entry.classes)}
    assert data["model"].endswith("ToyModel")
    assert miles_pm.fingerprint()["applied_patches"] == {"toy-patch": list(entry.classes)}


def test_preparing_twice_is_idempotent(miles_pm: MilesPluginManager, toy: SimpleNamespace) -> None:
    register(miles_pm, toy.Patch(toy.layer))
    model = toy.Model(toy.layer)
    first, second = prepare_model(model), prepare_model(model)
    assert first.applied == second.applied
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1


def test_a_patch_declining_a_model_that_holds_its_targets_is_refused(miles_pm, toy: SimpleNamespace) -> None:
    register(miles_pm, toy.Patch(toy.layer, match=False))
    with pytest.raises(ActivationError) as info:
        prepare_model(toy.Model(toy.layer, toy.Config("dense_variant")))
    message = str(info.value)
    assert "'toy-plugin' (toy-dist 9.9)" in message and "'toy-patch'" in message
    assert "matches() declined" in message and "ToyMixer" in message and "dense_variant" in message


def test_a_class_that_escaped_patching_fails_verification(miles_pm, toy: SimpleNamespace) -> None:
    register(miles_pm, toy.Patch(toy.layer))
    escaped = type("EscapedMixer", (toy.layer,), {})
    model = toy.Model(escaped)
    with pytest.raises(ActivationError, match="EscapedMixer lacks the marker"):
        prepare_model(model)
    # the failure is this model's, not the plugin's: another model still prepares
    assert miles_pm.get("toy-plugin").status == "ok"
    assert prepare_model(toy.Model(toy.layer)).applied


def test_a_failed_probe_stops_the_model(miles_pm, toy: SimpleNamespace) -> None:
    register(miles_pm, toy.Patch(toy.layer, probe_diff=0.5))
    with pytest.raises(ActivationError, match=r"numeric probe failed: max \|diff\| 0.5 > tolerance 1e-06"):
        prepare_model(toy.Model(toy.layer))
    assert miles_pm.fingerprint()["applied_patches"] == {}


def test_probe_false_skips_the_probe(miles_pm, toy: SimpleNamespace) -> None:
    register(miles_pm, toy.Patch(toy.layer, probe_diff=0.5))
    assert prepare_model(toy.Model(toy.layer), probe=False)["toy-patch"].probe is None


def test_environment_problems_break_the_plugin_once_checked(miles_pm, toy: SimpleNamespace) -> None:
    patch = toy.Patch(toy.layer, environment=["architecture 'foo' cannot be patched"])
    register(miles_pm, patch)
    with pytest.raises(ActivationError, match="architecture 'foo' cannot be patched"):
        prepare_model(toy.Model(toy.layer))
    assert miles_pm.get("toy-plugin").status == "broken"
    with pytest.raises(PluginLoadError, match="toy-plugin"):  # fails closed from now on
        prepare_model(toy.Model(toy.layer))


def test_the_environment_is_checked_once_per_manager(miles_pm, toy: SimpleNamespace) -> None:
    patch = toy.Patch(toy.layer)
    register(miles_pm, patch)
    prepare_model(toy.Model(toy.layer))
    prepare_model(toy.Model(toy.layer))
    assert patch.environment_checks == 1


def missing_kernel(required: bool, devices: tuple[str, ...] = ("cpu",)) -> KernelRequirement:
    return KernelRequirement("miles_no_such_kernel", "no-such-kernel", devices, "a fast path", required)


def test_a_missing_required_kernel_stops_the_model(miles_pm, toy: SimpleNamespace) -> None:
    register(miles_pm, toy.Patch(toy.layer, requires=[missing_kernel(required=True)]))
    with pytest.raises(ActivationError, match=r"no-such-kernel \(a fast path\) is missing on cpu"):
        prepare_model(toy.Model(toy.layer))


def test_a_missing_optional_kernel_warns_loudly(miles_pm, toy: SimpleNamespace) -> None:
    register(miles_pm, toy.Patch(toy.layer, requires=[missing_kernel(required=False)]))
    with pytest.warns(RuntimeWarning, match="no-such-kernel"):
        report = prepare_model(toy.Model(toy.layer))
    entry = report["toy-patch"]
    assert entry.kernels == {"miles_no_such_kernel": "missing: no-such-kernel is not installed"}
    assert entry.warnings and "no-such-kernel" in entry.warnings[0]


def test_a_kernel_for_another_device_is_not_checked(miles_pm, toy: SimpleNamespace) -> None:
    register(miles_pm, toy.Patch(toy.layer, requires=[missing_kernel(required=True, devices=("cuda",))]))
    assert prepare_model(toy.Model(toy.layer))["toy-patch"].kernels == {
        "miles_no_such_kernel": "not used on cpu"
    }


def test_kernel_states(tmp_path, monkeypatch) -> None:
    assert KernelRequirement("json", "json", ("cpu",), "x").state()[0] == "available"
    assert missing_kernel(False).state() == ("missing", "no-such-kernel is not installed")
    # the kernel package is there but one of its own dependencies is not: broken, not missing
    (tmp_path / "miles_half_kernel.py").write_text("import miles_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    state, detail = KernelRequirement("miles_half_kernel", "half-kernel", ("cpu",), "x").state()
    assert (state, detail) == ("broken", "ModuleNotFoundError: No module named 'miles_absent_dependency'")


def test_the_packing_scope_comes_only_with_a_patch_that_reads_it(miles_pm, toy: SimpleNamespace) -> None:
    model = toy.Model(toy.layer)
    report = prepare_model(model)  # no patch: the model's forward is left exactly as it was
    assert report.patches == () and not report.packing_scope
    assert not model._forward_pre_hooks and not model._forward_hooks

    class ContextFree(toy.Patch):
        uses_packing_context = False

    register(miles_pm, ContextFree(toy.layer))
    model = toy.Model(toy.layer)
    report = prepare_model(model)
    assert report.applied and not report.packing_scope

    scoped = toy.Model(toy.layer)
    assert prepare_model(scoped, pm=_with_patch(toy)).packing_scope
    scoped.eval()
    with torch.no_grad():
        scoped(torch.tensor([[1, 2, 3, 4]]), position_ids=torch.tensor([[0, 1, 0, 1]]))
    assert scoped.calls[-1]["use_cache"] is False  # a packed forward never uses the cache


def _with_patch(toy: SimpleNamespace) -> MilesPluginManager:
    pm = MilesPluginManager()
    register(pm, toy.Patch(toy.layer))
    return pm
