"""The per-forward packing context: derivation from position_ids, and scopes that always reset."""

from __future__ import annotations

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.patches.packing import (
    PackedSequences,
    PackingError,
    current_packed_sequences,
    enter_model_scope,
    exit_model_scope,
    model_scope_open,
    packed_position_ids,
    packed_sequences,
    packing_scope,
)

register_cpu_ci(est_time=3, suite="stage-a-cpu")


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows)


def test_three_documents_in_one_row() -> None:
    ctx = packed_sequences(ids([0, 1, 2, 0, 1, 0, 1, 2, 3]))
    assert ctx is not None
    assert ctx.cu_seqlens.tolist() == [0, 3, 5, 9] and ctx.cu_seqlens.dtype == torch.int32
    assert ctx.cu_seqlens_cpu.tolist() == [0, 3, 5, 9] and ctx.cu_seqlens_cpu.device.type == "cpu"
    assert ctx.seq_idx.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert (ctx.max_seqlen, ctx.num_sequences, ctx.lengths()) == (4, 3, [3, 2, 4])
    assert (ctx.batch_size, ctx.seq_len) == (1, 9)


@pytest.mark.parametrize(
    "position_ids",
    [None, ids([0, 1, 2, 3]), ids([0, 1, 2], [0, 1, 2]), ids([7]), torch.arange(5)],
    ids=["none", "one-document", "batch-of-two", "single-token", "1-d"],
)
def test_unpacked_batches_have_no_context(position_ids: torch.Tensor | None) -> None:
    assert packed_sequences(position_ids) is None


def test_padding_follows_its_positions() -> None:
    # zero positions: every pad token is a segment of its own
    assert packed_sequences(ids([0, 1, 2, 0, 1, 0, 0, 0])).lengths() == [3, 2, 1, 1, 1]
    # counting positions: the padding is one segment
    assert packed_sequences(packed_position_ids([3, 2], pad=3)).lengths() == [3, 2, 3]


def test_rows_are_flattened_and_each_row_starts_a_segment() -> None:
    ctx = packed_sequences(ids([0, 1, 2, 0, 1], [0, 1, 0, 1, 2]))
    assert ctx.cu_seqlens.tolist() == [0, 3, 5, 7, 10]
    assert ctx.seq_idx.tolist() == [[0, 0, 0, 1, 1], [2, 2, 3, 3, 3]]
    # a second row that continues counting still starts its own segment
    assert packed_sequences(ids([0, 1, 0, 1], [2, 3, 4, 5])).lengths() == [2, 2, 4]


def test_segments_follow_transformers_rule_for_position_gaps() -> None:
    # transformers' packed attention mask splits wherever a position is not its predecessor + 1
    assert packed_sequences(ids([0, 1, 2, 0, 1, 5, 6])).lengths() == [3, 2, 2]


def test_four_row_position_ids_use_the_text_row() -> None:
    text = ids([0, 1, 2, 0, 1])
    ctx = packed_sequences(torch.stack([text, text + 10, text + 20, text + 30]))
    assert ctx.lengths() == [3, 2]


def test_mrope_only_position_ids_cannot_be_packed() -> None:
    text = ids([0, 1, 2, 0, 1])
    with pytest.raises(PackingError, match="m-RoPE"):
        packed_sequences(torch.stack([text, text, text]))
    assert packed_sequences(torch.stack([ids([0, 1, 2])] * 3)) is None


def test_left_padding_with_a_mask_is_not_packing() -> None:
    # what generate() builds for a left-padded batch: pads at position 1, first real token at 0
    position_ids = ids([1, 1, 0, 1, 2], [0, 1, 2, 3, 4])
    mask = ids([0, 0, 1, 1, 1], [1, 1, 1, 1, 1])
    assert packed_sequences(position_ids, mask) is None


@pytest.mark.parametrize("mask", [ids([1, 1, 1, 1, 1]), ids([1, 1, 1, 1, 0])], ids=["ones", "padded"])
def test_packed_rows_with_an_attention_mask_are_refused(mask: torch.Tensor) -> None:
    with pytest.raises(PackingError, match="attention_mask=None"):
        packed_sequences(ids([0, 1, 2, 0, 1]), mask)


def test_a_mask_of_the_wrong_shape_names_both_shapes() -> None:
    with pytest.raises(PackingError, match=r"\(1, 4\).*\(1, 5\)"):
        packed_sequences(ids([0, 1, 2, 0, 1]), ids([1, 1, 1, 1]))


def test_from_lengths_matches_derivation() -> None:
    derived = packed_sequences(packed_position_ids([4, 1, 6]))
    built = PackedSequences.from_lengths([4, 1, 6])
    for field in ("cu_seqlens", "cu_seqlens_cpu", "seq_idx"):
        assert torch.equal(getattr(derived, field), getattr(built, field)), field
    assert (derived.max_seqlen, derived.seq_len) == (built.max_seqlen, built.seq_len)
    with pytest.raises(ValueError, match="positive"):
        PackedSequences.from_lengths([3, 0])


def test_scopes_reset_on_exit_and_on_error() -> None:
    outer = PackedSequences.from_lengths([2, 2])
    with packing_scope(outer):
        assert current_packed_sequences() is outer
        with packing_scope(None):  # an unpacked forward inside resets to None, not to the outer
            assert current_packed_sequences() is None
        assert current_packed_sequences() is outer
        with pytest.raises(RuntimeError), packing_scope(PackedSequences.from_lengths([1, 3])):
            raise RuntimeError("forward failed")
        assert current_packed_sequences() is outer
    assert current_packed_sequences() is None


def test_model_scopes_close_only_their_own() -> None:
    model_a, model_b = object(), object()
    ctx = PackedSequences.from_lengths([1, 1])
    assert not model_scope_open()
    enter_model_scope(model_a, ctx)
    exit_model_scope(model_b)  # b's entry failed before opening: a's scope stays
    assert model_scope_open() and current_packed_sequences() is ctx
    exit_model_scope(model_a)
    assert not model_scope_open() and current_packed_sequences() is None
