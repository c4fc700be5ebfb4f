"""Activation through the plugin manager: the probe of the installed paths is a registration
check, an unidentifiable path breaks the plugin (fail closed), prepare_model names what it did."""

from __future__ import annotations

import dataclasses

import pytest
from miles_mtp import conventions, plugin
from miles_mtp.conventions import GPT, MAMBA, ModelPath
from miles_mtp.patch import MTPLabelPatch

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ActivationError
from miles_core.patches import prepare_model

register_cpu_ci(est_time=12, suite="stage-a-cpu")


@dataclasses.dataclass(frozen=True)
class InstalledAs(ModelPath):
    """A path whose 'installed' class is a given one (what a different megatron-core would ship)."""

    cls: type = object

    def load(self) -> type:
        return self.cls


def test_the_installed_megatron_core_passes_the_registration_probe():
    assert MTPLabelPatch().check_environment() == []


def test_an_unidentifiable_installed_path_is_a_registration_error(doubles, monkeypatch):
    plain_roll = InstalledAs(GPT.name, GPT.module, GPT.class_name, GPT.interfaces, doubles.PlainRollGPTModel)
    monkeypatch.setattr(conventions, "PATHS", (plain_roll, MAMBA))
    (problem,) = MTPLabelPatch().check_environment()
    assert "PlainRollGPTModel" in problem and "no per-document shift" in problem


def test_prepare_model_fails_closed_and_marks_the_plugin_broken(
    doubles, monkeypatch, miles_pm, make_bare_model
):
    double_shift = InstalledAs(
        GPT.name, GPT.module, GPT.class_name, GPT.interfaces, doubles.DoubleShiftGPTModel
    )
    monkeypatch.setattr(conventions, "PATHS", (double_shift, MAMBA))
    record = miles_pm.register(plugin, name="miles-mtp", distribution="miles-mtp", version="0.1.0")
    with pytest.raises(ActivationError, match=r"'miles-mtp' \(miles-mtp 0.1.0\).*DoubleShiftGPTModel"):
        prepare_model(make_bare_model(doubles.ForkGPTModel, depths=1), pm=miles_pm, probe=False)
    assert record.status == "broken"


@pytest.mark.parametrize("name", ["fork-gpt", "mamba"])
def test_prepare_model_installs_the_adapter_of_each_path(doubles, miles_pm, make_bare_model, name):
    cls = doubles.conventions[name][0]
    miles_pm.register(plugin, name="miles-mtp", distribution="miles-mtp", version="0.1.0")
    report = prepare_model(make_bare_model(cls, depths=2), pm=miles_pm, probe=False)
    (applied,) = report.patches
    assert applied.name == "mtp-labels"
    assert applied.classes == (f"{cls.__module__}.{cls.__qualname__}",)
    assert applied.groups == {doubles.conventions[name][1][0]: applied.classes}
    assert miles_pm.applied_patches == {"mtp-labels": list(applied.classes)}


def test_models_without_mtp_are_not_targeted(make_bare_model, doubles):
    patch = MTPLabelPatch()
    model = make_bare_model(doubles.ForkGPTModel, depths=1)
    model.config.mtp_num_layers = None
    assert not patch.matches(model.config)
    assert patch.targets(model) == []
