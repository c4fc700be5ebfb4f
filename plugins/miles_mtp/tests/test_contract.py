"""The canonical batch: what it accepts, what it refuses, and the reference it is checked against."""

from __future__ import annotations

import pytest
import torch
from miles_mtp.batching import pack, rows, samples_of
from miles_mtp.contract import LabelContractError, MTPBatch, expected_depth
from miles_mtp.roll import SequenceLayout

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=3, suite="stage-a-cpu")

# two documents: "p p r r r" (2 prompt, 3 response tokens) and "p r r"
SAMPLES = [([10, 11, 12, 13, 14], [0, 0, 1, 1, 1]), ([20, 21, 22], [0, 1, 1])]


def test_pack_derives_the_token_aligned_mask_once():
    batch = pack(SAMPLES)
    assert batch.tokens.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22]]
    # loss_mask[i] trains tokens[i + 1]: positions 1..3 predict 12, 13, 14; 5..6 predict 21, 22
    assert batch.loss_mask.tolist() == [[0, 1, 1, 1, 0, 1, 1, 0]]
    assert batch.layout.cu_seqlens == (0, 5, 8)


def test_pack_pads_every_document_for_context_parallelism():
    batch = pack(SAMPLES, pad_to_multiple=4, pad_id=0)
    assert batch.layout.cu_seqlens == (0, 8, 12)
    assert batch.tokens.tolist() == [[10, 11, 12, 13, 14, 0, 0, 0, 20, 21, 22, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0]]


def test_rows_and_pack_hold_the_same_samples():
    assert samples_of(pack(SAMPLES)) == [(list(ids), list(trained)) for ids, trained in SAMPLES]
    row_samples = samples_of(rows(SAMPLES))
    assert row_samples[0] == (SAMPLES[0][0], SAMPLES[0][1])
    assert row_samples[1] == ([20, 21, 22, 0, 0], [0, 1, 1, 0, 0])


def test_reference_targets_and_masks_by_hand():
    batch = pack(SAMPLES)
    targets, inside, trained = expected_depth(batch.tokens, batch.loss_mask, batch.layout.cu_seqlens, 1)
    # depth 1: position i targets tokens[i + 2] inside its document
    assert inside.tolist() == [[True, True, True, False, False, True, False, False]]
    assert targets[inside].tolist() == [12, 13, 14, 22]
    # trained iff tokens[i + 2] is a response token: 12, 13, 14 (doc 0) and 22 (doc 1)
    assert trained.tolist() == [[True, True, True, False, False, True, False, False]]


def test_a_mask_trained_at_a_document_end_is_refused_naming_the_position():
    batch = pack(SAMPLES)
    mask = batch.loss_mask.clone()
    mask[0, 4] = 1  # position 4 is document 0's last token: nothing follows it inside the document
    with pytest.raises(
        LabelContractError, match=r"loss_mask\[0, 4\] = 1 trains past the end of its document"
    ):
        MTPBatch(batch.tokens, mask, batch.layout)


def test_the_response_aligned_mask_of_an_off_by_one_trainer_is_refused():
    tokens, trained = SAMPLES[0]
    with pytest.raises(LabelContractError, match="token-aligned"):
        MTPBatch(torch.tensor([tokens]), torch.tensor([trained]))  # trained[i] instead of trained[i + 1]


@pytest.mark.parametrize(
    ("tokens", "mask", "layout", "message"),
    [
        (torch.zeros(1, 4), torch.zeros(1, 4), SequenceLayout(), "integer tensor"),
        (torch.zeros(4, dtype=torch.long), torch.zeros(4), SequenceLayout(), "integer tensor"),
        (torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3), SequenceLayout(), "must match"),
        (torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), 0.5), SequenceLayout(), "only 0 and 1"),
        (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4), SequenceLayout((0, 2, 4)), "batch size 1"),
        (torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4), SequenceLayout((0, 2, 5)), "does not fit"),
    ],
)
def test_malformed_batches_are_refused(tokens, mask, layout, message):
    with pytest.raises(LabelContractError, match=message):
        MTPBatch(tokens, mask, layout)


def test_samples_must_have_one_flag_per_token():
    with pytest.raises(LabelContractError, match="sample 1: 3 token ids and 2 trained flags"):
        pack([SAMPLES[0], ([1, 2, 3], [0, 1])])
