"""`miles doctor` for patches: environment, kernels, each patch proven on its example models."""

from __future__ import annotations

from types import SimpleNamespace

from miles_core.ci.register import register_cpu_ci
from miles_core.doctor import run_doctor
from miles_core.patches import KernelRequirement
from miles_core.plugins import MilesPluginManager
from miles_core.testing import plugin_module

register_cpu_ci(est_time=3, suite="stage-a-cpu")


def with_examples(patch: object, **factories: object) -> object:
    patch.example_models = lambda: factories
    return patch


def register(pm: MilesPluginManager, patch: object) -> None:
    pm.register(plugin_module("toy", miles_model_patches=lambda: [patch]), name="toy-plugin")


def by_item(pm: MilesPluginManager) -> dict[str, object]:
    return {r.item: r for r in run_doctor(pm, ("patches",)).results}


def test_each_example_model_is_prepared_and_probed(miles_pm, toy: SimpleNamespace) -> None:
    optional = KernelRequirement("miles_no_such_kernel", "no-such-kernel", ("cuda",), "speed")
    patch = with_examples(toy.Patch(toy.layer, requires=[optional]), small=lambda: toy.Model(toy.layer))
    register(miles_pm, patch)
    results = by_item(miles_pm)
    assert results["toy-patch: environment"].status == "ok"
    kernel = results["toy-patch: kernel miles_no_such_kernel"]
    assert (kernel.status, kernel.required) == ("info", False)
    example = results["toy-patch: small"]
    assert example.status == "ok" and "ToyMixer" in example.detail and "probe max |diff|" in example.detail
    assert run_doctor(miles_pm, ("patches",)).ok
    assert miles_pm.fingerprint()["applied_patches"] == {"toy-patch": [f"{toy.layer.__module__}.ToyMixer"]}


def test_an_example_model_that_fails_is_a_failed_check(miles_pm, toy: SimpleNamespace) -> None:
    escaped = type("EscapedMixer", (toy.layer,), {})
    register(miles_pm, with_examples(toy.Patch(toy.layer), escaped=lambda: toy.Model(escaped)))
    report = run_doctor(miles_pm, ("patches",))
    failed = {r.item: r for r in report.results}["toy-patch: escaped"]
    assert failed.status == "fail" and "EscapedMixer lacks the marker" in failed.detail
    assert not report.ok


def test_environment_problems_fail_the_doctor(miles_pm, toy: SimpleNamespace) -> None:
    register(miles_pm, toy.Patch(toy.layer, environment=["architecture 'foo' is not covered"]))
    report = run_doctor(miles_pm, ("patches",))
    result = {r.item: r for r in report.results}["toy-patch: environment"]
    assert result.status == "fail" and "foo" in result.detail and not report.ok


def test_an_example_model_the_patch_declines_is_a_failed_check(miles_pm, toy: SimpleNamespace) -> None:
    other = toy.make_layer("OtherMixer")
    register(miles_pm, with_examples(toy.Patch(toy.layer, match=False), unrelated=lambda: toy.Model(other)))
    report = run_doctor(miles_pm, ("patches",))
    failed = {r.item: r for r in report.results}["toy-patch: unrelated"]
    assert failed.status == "fail" and "does not apply to its own example model" in failed.detail
    assert not report.ok
