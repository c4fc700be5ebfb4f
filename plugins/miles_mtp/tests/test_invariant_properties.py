"""The invariant, property-tested for every convention: random packings (1-8 documents of 1-64
tokens), depths 1-3, loss masks with prompt/response spans, packed rows, padded rows, and a
simulated 2-way context-parallel split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from miles_mtp.adapter import LabelAdapter
from miles_mtp.batching import pack, rows
from miles_mtp.contract import contract_violations
from miles_mtp.conventions import path_for
from miles_mtp.probe import detect
from miles_mtp.roll import SequenceLayout, shard
from miles_mtp.verification import check_adapter, simulate_context_parallel

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=14, suite="stage-a-cpu")

NAMES = ["upstream-gpt", "fork-gpt", "mamba"]


@st.composite
def documents(draw, max_docs: int = 8, max_len: int = 64):
    """Samples of alternating untrained (prompt, tool output) and trained (response) spans."""
    samples = []
    for _ in range(draw(st.integers(1, max_docs))):
        length = draw(st.integers(1, max_len))
        cuts = sorted(draw(st.sets(st.integers(1, length), max_size=4)) | {length})
        trained, start, flag = [], 0, 0
        for cut in cuts:
            trained += [flag] * (cut - start)
            start, flag = cut, 1 - flag
        ids = draw(st.lists(st.integers(1, 50_000), min_size=length, max_size=length))
        samples.append((ids, trained))
    return samples


@pytest.fixture(scope="module")
def adapters(doubles):
    out = {}
    for name in NAMES:
        cls = doubles.conventions[name][0]
        convention = detect(path_for(cls), cls)
        out[name] = (cls, convention, LabelAdapter(convention))
    return out


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(samples=documents(), depths=st.integers(1, 3))
def test_every_depth_trains_on_the_token_it_should(adapters, name, samples, depths):
    cls, _, adapter = adapters[name]
    assert check_adapter(cls, adapter, depths, batches=[pack(samples), rows(samples)]) == []


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(samples=documents(), depths=st.integers(1, 3))
def test_every_depth_trains_on_the_token_it_should_under_two_way_context_parallelism(
    adapters, name, samples, depths
):
    _, convention, adapter = adapters[name]
    batch = pack(samples, pad_to_multiple=4)
    cu = batch.layout.cu_seqlens
    sharded, observed = simulate_context_parallel(adapter, convention, batch, depths, cp_size=2)
    assert contract_violations(observed, batch.tokens, batch.loss_mask, cu, depths) == []
    # each rank's model inputs are exactly its shard of the unsplit inputs
    whole = adapter.model_kwargs(batch)
    label_key = convention.interface.name if convention.interface.name != "mtp_kwargs" else None
    for rank, kwargs in enumerate(sharded):
        layout = SequenceLayout(cu, 2, rank)
        labels = kwargs["mtp_kwargs"]["mtp_labels"] if label_key is None else kwargs[label_key]
        whole_labels = whole["mtp_kwargs"]["mtp_labels"] if label_key is None else whole[label_key]
        assert torch.equal(labels, shard(whole_labels, layout))
        assert torch.equal(kwargs["loss_mask"], shard(whole["loss_mask"], layout))
