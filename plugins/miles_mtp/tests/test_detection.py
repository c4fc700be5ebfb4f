"""Convention detection by behaviour: each installed or doubled path is probed, never version-sniffed."""

from __future__ import annotations

import pytest
from megatron.core.models.gpt import GPTModel
from miles_mtp.contract import LabelContractError
from miles_mtp.conventions import GPT, MAMBA, path_for
from miles_mtp.probe import accepts, detect

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=9, suite="stage-a-cpu")


@pytest.mark.parametrize("name", ["upstream-gpt", "fork-gpt", "mamba"])
def test_each_convention_is_recognised_by_what_its_depths_train_on(doubles, name):
    cls, (interface, label_shifts, mask_shifts) = doubles.conventions[name]
    convention = detect(path_for(cls), cls)
    assert convention is not None
    assert (convention.interface.name, convention.label_pre_shifts, convention.mask_pre_shifts) == (
        interface,
        label_shifts,
        mask_shifts,
    )
    assert convention.model_class.endswith(cls.__qualname__)


def test_the_installed_megatron_core_implements_the_upstream_gpt_convention():
    convention = detect(GPT)
    assert convention is not None
    assert convention.model_class == f"{GPTModel.__module__}.GPTModel"
    assert convention.describe().endswith("takes next-token labels through labels=<labels>, loss_mask=<mask>")


def test_a_path_whose_forward_takes_no_mtp_labels_has_no_convention():
    class NoLabelsGPTModel(GPTModel):
        def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None):
            return super().forward(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)

    assert detect(GPT, NoLabelsGPTModel) is None


def test_the_installed_mamba_path_has_a_convention_exactly_when_it_takes_mtp_labels():
    # megatron-core 0.16's MambaModel.forward takes neither mtp_labels= nor loss_mask=; 0.19's takes
    # labels= and loss_mask= and trains its MTP depths on them
    mamba = MAMBA.load()
    assert mamba is not None
    convention = detect(MAMBA)
    if any(accepts(mamba, interface) for interface in MAMBA.interfaces):
        assert convention is not None and convention.model_class.endswith("MambaModel"), convention
    else:
        assert convention is None


def test_a_path_that_rolls_across_documents_is_a_registration_error(doubles):
    with pytest.raises(LabelContractError, match=r"PlainRollGPTModel.*no per-document shift"):
        detect(GPT, doubles.PlainRollGPTModel)


def test_a_path_that_shifts_twice_before_depth_one_is_a_registration_error(doubles):
    with pytest.raises(LabelContractError, match=r"DoubleShiftGPTModel.*shifted 3 time\(s\), not 1 or 2"):
        detect(GPT, doubles.DoubleShiftGPTModel)


def test_a_path_the_probe_cannot_run_is_a_registration_error_naming_the_cause():
    class Broken(GPTModel):
        def forward(
            self,
            input_ids,
            position_ids,
            attention_mask,
            labels=None,
            packed_seq_params=None,
            *,
            loss_mask=None,
        ):
            raise RuntimeError("kernel missing")

    with pytest.raises(
        LabelContractError, match=r"Broken: probing it through labels=.*RuntimeError: kernel missing"
    ):
        detect(GPT, Broken)
