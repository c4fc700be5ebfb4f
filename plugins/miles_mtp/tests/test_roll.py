"""The per-document, context-parallel-aware roll: against megatron-core's ``roll_tensor``, against
the index-arithmetic reference, and sharded (simulated CP) against unsharded."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_token_prediction import roll_tensor
from miles_mtp.contract import expected_depth
from miles_mtp.roll import LEFT, RIGHT, SequenceLayout, roll, roll_shards, shard, unshard

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=9, suite="stage-a-cpu")


def packings(multiple: int = 1, max_docs: int = 8, max_len: int = 64):
    lengths = st.lists(
        st.integers(1, max_len // multiple).map(lambda n: n * multiple), min_size=1, max_size=max_docs
    )
    return lengths.map(lambda ls: tuple(int(v) for v in torch.tensor([0, *ls]).cumsum(0)))


def values(total: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 1000, (1, total), generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, deadline=None)
@given(cu=packings(), seed=st.integers(0, 2**16))
def test_left_roll_equals_megatron_roll_tensor_on_packed_rows(cu, seed):
    x = values(cu[-1], seed)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    theirs, _ = roll_tensor(x, shifts=-1, dims=-1, packed_seq_params=params)
    assert torch.equal(roll(x, LEFT, SequenceLayout(cu)), theirs)


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 4), length=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_left_roll_equals_megatron_roll_tensor_on_rows(batch, length, seed):
    x = torch.randint(1, 1000, (batch, length), generator=torch.Generator().manual_seed(seed))
    theirs, _ = roll_tensor(x, shifts=-1, dims=-1)
    assert torch.equal(roll(x, LEFT), theirs)


@settings(max_examples=60, deadline=None)
@given(cu=packings(), seed=st.integers(0, 2**16))
def test_left_roll_is_the_next_token_of_the_reference(cu, seed):
    x = values(cu[-1], seed)
    targets, inside, _ = expected_depth(x, x, cu, 0)
    rolled = roll(x, LEFT, SequenceLayout(cu))
    assert torch.equal(rolled[inside], targets[inside])
    assert not rolled[~inside].any(), "each document's last position must be zero-filled"


@settings(max_examples=60, deadline=None)
@given(cu=packings(), seed=st.integers(0, 2**16))
def test_right_roll_undoes_left_roll_when_document_ends_are_zero(cu, seed):
    layout = SequenceLayout(cu)
    x = roll(values(cu[-1], seed), LEFT, layout)  # zero at every document's last position
    assert torch.equal(roll(roll(x, RIGHT, layout), LEFT, layout), x)


@settings(max_examples=60, deadline=None)
@given(
    cp=st.sampled_from([2, 4]),
    data=st.data(),
    seed=st.integers(0, 2**16),
    shift=st.sampled_from([LEFT, RIGHT]),
)
def test_simulated_context_parallel_roll_equals_the_unsplit_roll(cp, data, seed, shift):
    cu = data.draw(packings(multiple=2 * cp))
    x = values(cu[-1], seed)
    shards = [shard(x, SequenceLayout(cu, cp, r)) for r in range(cp)]
    assert torch.equal(unshard(shards, cu), x)
    assert torch.equal(unshard(roll_shards(shards, shift, cu), cu), roll(x, shift, SequenceLayout(cu)))


def test_context_parallel_shards_follow_megatrons_load_balanced_split():
    x = torch.arange(16).unsqueeze(0)
    # one document of 16 tokens in 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert shard(x, SequenceLayout((0, 16), 2, 0)).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard(x, SequenceLayout((0, 16), 2, 1)).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    # rows without packing are one document each
    assert shard(x, SequenceLayout(None, 2, 1)).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]


def test_real_context_parallel_needs_its_process_group():
    with pytest.raises(ValueError, match="CP process group"):
        roll(torch.zeros(1, 8), LEFT, SequenceLayout((0, 16), 2, 0))


@pytest.mark.parametrize(
    ("layout", "length", "rule"),
    [
        (dict(cu_seqlens=(0, 6), cp_size=2), 3, "multiple of 4"),
        (dict(cu_seqlens=(0, 4, 4)), 4, "strictly increasing"),
        (dict(cu_seqlens=(1, 4)), 3, "start at 0"),
        (dict(cu_seqlens=(0, 4)), 5, "ends at 4 but the sequence holds 5"),
        (dict(cp_size=2, cp_rank=2), 4, "cp_rank"),
    ],
)
def test_bad_layouts_are_rejected_naming_the_rule(layout, length, rule):
    with pytest.raises(ValueError, match=rule):
        roll(torch.zeros(1, length), LEFT, SequenceLayout(**layout))
