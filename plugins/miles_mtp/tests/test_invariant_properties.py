"""The invariant, property-tested for every convention: random packings (1-8 documents of 1-64
tokens), depths 1-3, loss masks with prompt/response spans, packed rows, padded rows, and a
simulated 2-way context-parallel split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from miles_mtp.adapter import LabelAdapter
from miles_mtp.batching import pack, rows
from miles_mtp.conventions import path_for
from miles_mtp.probe import detect
from miles_mtp.roll import roll
from miles_mtp.verification import check_adapter, context_parallel_violations

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
    assert context_parallel_violations(adapter, convention, batch, depths, cp_size=2) == []


def test_a_roll_that_ignores_the_other_rank_is_caught(adapters, monkeypatch):
    """Negative control of the CP check: each rank rolling its shard alone (no exchange)."""
    import miles_mtp.verification as verification

    def local_only(shards, shift, cu_seqlens):
        return [roll(piece, shift) for piece in shards]

    monkeypatch.setattr(verification, "roll_shards", local_only)
    _, convention, adapter = adapters["upstream-gpt"]
    batch = pack([(list(range(1, 13)), [0] * 3 + [1] * 9)], pad_to_multiple=4)
    problems = context_parallel_violations(adapter, convention, batch, depths=1, cp_size=2)
    assert any("differ from its labels unsplit" in p for p in problems), problems
