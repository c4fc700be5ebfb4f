"""Identical samples of a minibatch are trained once, weighted by their number: the same update
(loss, gradients, every statistic) as training each copy, on fewer tokens.

Tolerance: both runs add the same per-token terms; the merged one multiplies a term by its count
where the other adds the copies one by one, in another order across rows of other sizes. In fp32
that is a few ulps of the values involved (rel 1e-5, abs 1e-7; measured: gradients <= 2e-7 of the
largest, statistics <= 3e-6 relative, or 2e-9 absolute where the loss's terms cancel to ~3e-5
(gspo)), as in the shared-prompt differential (test_shared_prompts.py), whose model
(conftest's ``packed_lm``) this file uses.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.algorithms.batch import TrainDocument, merge_duplicates, pack_documents
from miles_core.rl.algorithms.builtin import BUILTIN_ALGORITHMS
from miles_core.rl.config import AlgorithmSection
from miles_core.rl.policy_update import UpdateSettings

register_cpu_ci(est_time=8, suite="stage-a-cpu")

STATS = ("loss", "entropy", "approx_kl", "kl_ref", "clip_fraction", "logprob_mismatch_mean", "logprob_mismatch_kl",
         "logprob_mismatch_max")


def _doc(prompt: list[int], response: list[int], advantage: float, logprob: float = -2.0) -> TrainDocument:
    n = len(response)
    mask = tuple(0 if (j == 1 and n == 3) else 1 for j in range(n))  # a tool token inside 3-token answers
    return TrainDocument(tuple(prompt + response), n, mask, tuple(logprob - 0.1 * j for j in range(n)), advantage)


def _docs() -> list[TrainDocument]:
    """Groups with repeated answers (as a sharpened policy samples them; the last one collapsed to
    a single answer), and near-repeats that differ in one field only, which must stay separate."""
    a, b, c, d = [3, 7, 1, 9, 4, 2], [5, 5, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]
    return [
        _doc(a, [21], 0.5), _doc(a, [22, 23], -1.0), _doc(a, [21], 0.5), _doc(a, [21], 0.5),
        _doc(a, [21], 0.25),  # same tokens, another advantage
        _doc(b, [24, 25, 26], 1.0), _doc(b, [24, 25, 26], 1.0), _doc(b, [24, 25, 26], 1.0, logprob=-2.5),
        _doc(c, [27], -0.5), _doc(c, [28, 29], 0.5), _doc(c, [27], -0.5),
        _doc(d, [30, 31], 0.0), _doc(d, [30, 31], 0.0), _doc(d, [30, 31], 0.0),
    ]


def test_exact_repeats_merge_into_their_first_copy() -> None:
    docs = _docs()
    merged = merge_duplicates(docs)
    assert [d.multiplicity for d in merged] == [3, 1, 1, 2, 1, 2, 1, 3]
    assert merged == [replace(docs[i], multiplicity=m) for i, m in
                                   zip([0, 1, 4, 5, 7, 8, 9, 11], [3, 1, 1, 2, 1, 2, 1, 3], strict=True)]
    assert sum(d.multiplicity for d in merge_duplicates(merged + docs)) == 2 * len(docs)  # merged ones merge on
    distinct = [d for i, d in enumerate(docs) if i in (0, 1, 4, 5, 7, 8, 9, 11)]
    assert merge_duplicates(distinct) == distinct


def test_merging_keeps_every_sample_and_only_merges_equals() -> None:
    """Random batches from a small pool of samples and their near twins, which share everything
    the candidate key reads (advantage, lengths, last token and log-prob) and differ in an earlier
    token, the loss mask or a log-prob (each comparison dropped from the merge fails this)."""
    import random

    rng = random.Random(7)
    pool = []
    for _ in range(6):
        base = TrainDocument(tuple([rng.randrange(1, 5) for _ in range(3)] + [rng.randrange(1, 3), 2, 9]), 3,
                             (1, 1, 1), (-1.0, -0.5, -0.25), rng.choice([0.5, -0.5]))
        pool += [  # and its near twins, each different in one field the candidate key does not read
            base,
            replace(base, token_ids=(*base.token_ids[:3], 3 - base.token_ids[3], 2, 9)),
            replace(base, loss_mask=(1, 0, 1)),
            replace(base, rollout_logprobs=(-2.0, -0.5, -0.25)),
            replace(base, multiplicity=2),
        ]
    for _ in range(50):
        docs = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        merged = merge_duplicates(docs)
        assert sum(d.multiplicity for d in merged) == sum(d.multiplicity for d in docs)
        plain = [replace(d, multiplicity=1) for d in merged]
        assert len(set(plain)) == len(plain)  # what is left is pairwise different
        first_seen = list(dict.fromkeys(replace(d, multiplicity=1) for d in docs))
        assert plain == first_seen  # in order of first occurrence
        for d in merged:
            twin = replace(d, multiplicity=1)
            assert d.multiplicity == sum(x.multiplicity for x in docs if replace(x, multiplicity=1) == twin)


def test_a_multiplicity_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="multiplicity 0"):
        TrainDocument((1, 2), 1, (1,), (-1.0,), 0.0, multiplicity=0)


def _settings(method, *, merge: bool, share: bool, max_tokens: int = 64) -> UpdateSettings:
    algo = AlgorithmSection(lr=1e-2, entropy_coef=0.01, kl_coef=0.1)
    return UpdateSettings(algo, 1.0, max_tokens, True, method=method, budget=3.0, share_prompts=share,
                          merge_duplicates=merge)


@pytest.fixture
def models(packed_lm):
    torch.set_num_threads(1)
    model, reference = packed_lm(), packed_lm()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02)
    return model, reference


@pytest.mark.parametrize("method", BUILTIN_ALGORITHMS, ids=lambda a: a.name)
@pytest.mark.parametrize("share", [False, True], ids=["whole", "shared-prompts"])
def test_merged_repeats_give_the_update_of_every_copy(models, lr0_update, method, share) -> None:
    model, reference = models
    docs = _docs()
    every, grads_every = lr0_update(model, docs, _settings(method, merge=False, share=share), reference)
    merged, grads_merged = lr0_update(model, docs, _settings(method, merge=True, share=share), reference)
    assert merged["train_tokens"] < 0.85 * every["train_tokens"]  # the repeats really were left out
    assert (merged["merged_samples"], every["merged_samples"]) == (6, 0)
    for key in STATS:
        assert merged[key] == pytest.approx(every[key], rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(grads_merged, grads_every, rtol=1e-5, atol=1e-7)

    # negative control: the repeats dropped instead of weighted give another update
    dropped = [replace(d, multiplicity=1) for d in merge_duplicates(docs)]
    _, grads_dropped = lr0_update(model, dropped, _settings(method, merge=False, share=share), reference)
    assert not torch.allclose(grads_dropped, grads_every, rtol=1e-3, atol=1e-5)


def test_merging_holds_across_minibatch_rows(models, lr0_update) -> None:
    """Rows of 16 tokens: copies land in other rows than their first occurrence when unmerged."""
    model, reference = models
    grpo = BUILTIN_ALGORITHMS[0]
    every, grads_every = lr0_update(model, _docs(), _settings(grpo, merge=False, share=False, max_tokens=16), reference)
    merged, grads_merged = lr0_update(model, _docs(), _settings(grpo, merge=True, share=False, max_tokens=16), reference)
    assert merged["loss"] == pytest.approx(every["loss"], rel=1e-5)
    torch.testing.assert_close(grads_merged, grads_every, rtol=1e-5, atol=1e-7)


def test_a_row_loss_of_the_backend_keeps_every_copy(models, lr0_update) -> None:
    """An auxiliary loss (MTP) is the row's own: with one, the update lays out every copy."""
    model, reference = models
    grpo = BUILTIN_ALGORITHMS[0]
    seen: list[int] = []

    def extra(row):
        seen.append(row.num_docs)
        return torch.zeros(())

    lr0_update(model, _docs(), _settings(grpo, merge=True, share=False, max_tokens=4096), reference, extra)
    assert seen == [len(_docs())]


def test_groups_of_one_shape_sit_side_by_side_for_the_attention() -> None:
    """Shared-prompt groups of two shapes, interleaved in sample order: the row lays each shape's
    groups out next to each other, so the attention reads them as views of the row (no gather,
    no reordering of its output)."""
    from miles_core.patches.attention import _plan
    from miles_core.patches.packing import packed_sequences

    docs = []
    for g in range(6):
        prompt = [1 + g, 2, 3] if g % 2 else [1 + g, 2, 3, 4, 5]
        docs += [_doc(prompt, [20 + i], 0.1 * i) for i in range(2 + g % 2)]
    (row,) = pack_documents(docs, 256, share_prompts=True)
    plan = _plan(packed_sequences(row.position_ids[None], branches=row.branches), torch.device("cpu"))
    assert len(plan.jobs) == 2
    assert all(job.span is not None for job in plan.jobs)
    assert plan.inverse is None
