"""The CPU harness on a real tiny megatron GPTModel with MTP, built through the cpu backend:
prepare_model installs and verifies the adapter, a real forward agrees with the stand-in probe,
packed and padded-row batches train identically, and a mis-shifted adapter fails the probe."""

from __future__ import annotations

import random

import pytest
import torch
from miles_mtp.adapter import installed_adapter
from miles_mtp.batching import pack, rows, samples_of
from miles_mtp.contract import LabelContractError
from miles_mtp.experiment import ExtraShiftAdapter, arithmetic_sample
from miles_mtp.harness import (
    TinyGPTConfig,
    build_tiny_gpt,
    evaluate,
    forward_losses,
    forward_token_losses,
    train_step,
)
from miles_mtp.patch import MTPLabelPatch
from miles_mtp.probe import observe, probe_config
from miles_mtp.verification import observe_model, verification_batches

from miles_core.ci.register import register_cpu_ci
from miles_core.hardware.megatron_state import causal_attention_mask
from miles_core.patches import PatchVerificationError

register_cpu_ci(est_time=18, suite="stage-a-cpu")

VOCAB = 32


@pytest.fixture
def tiny(megatron_state):
    pm, hw = megatron_state
    model, report = build_tiny_gpt(TinyGPTConfig(vocab_size=VOCAB, mtp_num_layers=2), hw.device, pm)
    return model, report


def test_prepare_model_reports_the_patch_and_its_real_forward_probe(tiny):
    model, report = tiny
    (patch,) = report.patches
    assert patch.name == "mtp-labels" and patch.plugin == "miles-mtp"
    assert patch.classes == (f"{type(model).__module__}.GPTModel",)
    assert patch.probe is not None and patch.probe.passed, patch.probe
    assert installed_adapter(model).convention.interface.name == "labels"


def test_a_real_forward_trains_each_depth_on_what_the_stand_in_probe_saw(tiny):
    model, _ = tiny
    batch = verification_batches(2, vocab_size=VOCAB)[1]
    real = observe_model(model, batch)
    adapter = installed_adapter(model)
    from miles_mtp.adapter import install

    stand_in = observe(
        type(model),
        probe_config(2, model.config),
        batch.tokens,
        {"loss_mask": batch.loss_mask},
        lambda m: install(m, adapter),
    )
    assert sorted(real) == sorted(stand_in) == [0, 1, 2]
    for depth in real:
        assert torch.equal(real[depth].labels, stand_in[depth].labels), depth
        if depth:
            peak_real, peak_stand_in = real[depth].weight.max(), stand_in[depth].weight.max()
            assert torch.equal(real[depth].weight > 0, stand_in[depth].weight > 0), depth
            assert torch.allclose(real[depth].weight / peak_real, stand_in[depth].weight / peak_stand_in)


def test_packed_and_padded_row_batches_train_identically(tiny):
    model, _ = tiny
    samples = [arithmetic_sample(random.Random(i), VOCAB) for i in range(4)]
    packed, padded = evaluate(model, pack(samples)), evaluate(model, rows(samples))
    assert packed == padded
    assert len(packed.mtp_losses) == 2 and all(v > 0 for v in packed.mtp_losses)


def test_a_train_step_reports_main_and_per_depth_losses_and_updates_weights(tiny):
    model, _ = tiny
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = pack([arithmetic_sample(random.Random(i), VOCAB) for i in range(4)])
    before = [p.detach().clone() for p in model.parameters()]
    first = train_step(model, optimizer, batch)
    assert len(first.mtp_losses) == 2
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert evaluate(model, batch).main_loss < first.main_loss
    main, mtp = forward_losses(model, batch)
    assert main.requires_grad and len(mtp) == 2


def test_a_mis_shifted_adapter_on_a_real_model_fails_verify_and_probe(tiny):
    model, _ = tiny
    from miles_mtp.adapter import install

    install(model, ExtraShiftAdapter(installed_adapter(model).convention))
    patch = MTPLabelPatch()
    with pytest.raises(PatchVerificationError, match=r"toward tokens\[i \+ 3\]"):
        patch.verify(model)
    result = patch.probe(model)
    assert not result.passed and "tokens[i + 3]" in result.detail


def test_the_adapted_model_refuses_labels_and_a_missing_mask(tiny):
    model, _ = tiny
    batch = rows(samples_of(pack([arithmetic_sample(random.Random(0), VOCAB)])))
    seq = batch.tokens.shape[1]
    args = (batch.tokens, torch.arange(seq)[None], causal_attention_mask(seq))
    with pytest.raises(LabelContractError, match="would shift twice"):
        model(*args, labels=batch.tokens, loss_mask=batch.loss_mask)
    with pytest.raises(LabelContractError, match="loss_mask is required"):
        model(*args)


def test_token_losses_come_per_sample_row_and_do_not_leak_between_rows(tiny):
    model, _ = tiny
    samples = [arithmetic_sample(random.Random(i), VOCAB) for i in range(3)]
    with torch.no_grad():
        together = forward_token_losses(model, pack(samples))
        alone = [forward_token_losses(model, pack([sample])) for sample in samples]
    assert together.batch.tokens.shape[0] == 3  # packed documents ran as padded rows, in order
    for row, (sample, single) in enumerate(zip(samples, alone)):
        length = len(sample[0])
        assert together.batch.tokens[row, :length].tolist() == sample[0]
        assert torch.allclose(together.nll[row, :length], single.nll[0], atol=1e-5), row
    mask = together.batch.float_mask()
    assert torch.allclose(together.mean_nll(), (together.nll * mask).sum() / mask.sum())
