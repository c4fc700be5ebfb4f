"""The two upstream bugs, reproduced and caught by the patch's verify():

* the double shift: a call site pre-shifted the labels for a path that shifts raw tokens itself,
  so MTP depth 1 trained toward tokens[i + 3] instead of tokens[i + 2];
* the loss mask one position ahead of its labels (the fork rolls its mask once more than its
  labels; fed the contract's mask unchanged, the last prompt token is trained and the last
  response token is not).
"""

from __future__ import annotations

import dataclasses

import pytest
from miles_mtp import plugin
from miles_mtp.adapter import LabelAdapter, install
from miles_mtp.patch import MTPLabelPatch
from miles_mtp.probe import convention_of
from miles_mtp.roll import LEFT

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ActivationError
from miles_core.patches import PatchVerificationError

register_cpu_ci(est_time=8, suite="stage-a-cpu")


class CallSiteShiftAdapter(LabelAdapter):
    """The upstream call-site bug: shift once more than the model's convention asks for."""

    def path_inputs(self, tokens, loss_mask, shift):
        labels, mask = super().path_inputs(tokens, loss_mask, shift)
        return shift(labels, LEFT), mask


def installed(model, adapter):
    install(model, adapter)
    return model


@pytest.mark.parametrize("name", ["upstream-gpt", "fork-gpt", "mamba"])
def test_the_matching_adapter_passes_verify(doubles, make_bare_model, name):
    cls = doubles.conventions[name][0]
    model = make_bare_model(cls, depths=2)
    patch = MTPLabelPatch()
    assert patch.targets(model) == [cls]
    applied = patch.apply(model)
    assert applied.classes == (f"{cls.__module__}.{cls.__qualname__}",)
    patch.verify(model)


@pytest.mark.parametrize("name", ["upstream-gpt", "fork-gpt", "mamba"])
def test_a_double_shift_is_caught_by_verify(doubles, make_bare_model, name):
    cls = doubles.conventions[name][0]
    model = installed(make_bare_model(cls, depths=2), CallSiteShiftAdapter(convention_of(cls)))
    with pytest.raises(
        PatchVerificationError, match=r"depth 1.*toward tokens\[i \+ 3\] instead of tokens\[i \+ 2\]"
    ):
        MTPLabelPatch().verify(model)


def test_the_upstream_double_shift_of_the_fork_is_caught_by_verify(doubles, make_bare_model):
    # the exact upstream sequence: pre-shifted labels handed to the fork, which shifts raw tokens
    fork = convention_of(doubles.ForkGPTModel)
    pre_shifting = LabelAdapter(dataclasses.replace(fork, label_pre_shifts=0))
    model = installed(make_bare_model(doubles.ForkGPTModel, depths=1), pre_shifting)
    with pytest.raises(PatchVerificationError, match=r"toward tokens\[i \+ 3\] instead of tokens\[i \+ 2\]"):
        MTPLabelPatch().verify(model)


def test_a_mask_one_position_ahead_of_its_labels_is_caught_by_verify(doubles, make_bare_model):
    fork = convention_of(doubles.ForkGPTModel)
    unaligned = LabelAdapter(dataclasses.replace(fork, mask_pre_shifts=0))  # contract mask passed as is
    model = installed(make_bare_model(doubles.ForkGPTModel, depths=2), unaligned)
    with pytest.raises(PatchVerificationError, match=r"1 position\(s\) ahead of its labels"):
        MTPLabelPatch().verify(model)


def test_verify_through_the_plugin_manager_names_plugin_and_cause(doubles, make_bare_model, miles_pm):
    record = miles_pm.register(plugin, name="miles-mtp", distribution="miles-mtp", version="0.1.0")
    assert record.status == "ok"
    contribution = miles_pm.contribution("patches", "mtp-labels")
    model = installed(
        make_bare_model(doubles.ForkGPTModel, depths=1),
        CallSiteShiftAdapter(convention_of(doubles.ForkGPTModel)),
    )
    with pytest.raises(ActivationError) as info:
        miles_pm.verify(contribution, contribution.obj.verify, model)
    message = str(info.value)
    assert "'miles-mtp' (miles-mtp 0.1.0)" in message and "'mtp-labels'" in message
    assert "tokens[i + 3]" in message


def test_a_model_without_an_adapter_fails_verify(doubles, make_bare_model):
    model = make_bare_model(doubles.ForkMambaModel, depths=1)
    with pytest.raises(PatchVerificationError, match="carries no MTP label adapter"):
        MTPLabelPatch().verify(model)
