"""Conformance kit for algorithm authors (``miles_algorithms``)::

    from miles_core.testing.algorithms import assert_algorithm_conforms

    def test_my_algorithm_conforms():
        assert_algorithm_conforms(MyAlgorithm(), expected_loss=0.1234)  # your documented probe value

It checks the declarations against the protocol (:class:`miles_core.rl.algorithms.base.Algorithm`),
that advantages keep the batch's shape and are finite, that the loss on the probe batch
(:mod:`miles_core.rl.algorithms.probe`) has the documented value and the gradient signs every
policy-gradient method gives there, that a row's loss does not depend on which documents are
packed with it, and that ``verify()`` passes. Needs torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from miles_core.rl.algorithms.base import AGGREGATIONS, ROLLOUT_FIELDS, SHARED_SETTINGS, Algorithm, TokenBatch
from miles_core.rl.algorithms.probe import DELTAS, ROLLOUT_LOGPROB, ProbeResult, check_probe

if TYPE_CHECKING:
    from miles_core.rl.config import AlgorithmSection


def assert_algorithm_conforms(algorithm: Algorithm, *, expected_loss: float | None = None) -> ProbeResult:
    import torch

    from miles_core.rl.config import AlgorithmSection

    assert isinstance(algorithm, Algorithm), f"{algorithm!r} lacks attributes of the Algorithm protocol"
    assert isinstance(algorithm.name, str) and algorithm.name, "name must be a non-empty str"
    assert algorithm.description and algorithm.reference, "describe the algorithm and name its reference"
    assert set(algorithm.needs) <= ROLLOUT_FIELDS.keys(), f"needs unknown rollout fields {set(algorithm.needs) - ROLLOUT_FIELDS.keys()}"
    assert algorithm.aggregation in AGGREGATIONS, f"aggregation {algorithm.aggregation!r} is not one of {AGGREGATIONS}"
    assert isinstance(algorithm.min_group_size, int) and algorithm.min_group_size >= 1
    known = AlgorithmSection.model_fields.keys() - SHARED_SETTINGS
    assert set(algorithm.settings) <= known, f"reads unknown algorithm settings {set(algorithm.settings) - known}"
    assert set(algorithm.defaults) <= set(algorithm.settings), "defaults may only cover settings it reads"
    AlgorithmSection.model_validate({"name": algorithm.name, **algorithm.defaults})  # its defaults validate

    settings = AlgorithmSection(name=algorithm.name)
    group = max(2, algorithm.min_group_size)
    rewards = torch.tensor([1.0, 0.0] * group)[: 2 * group]
    advantages = algorithm.advantages(rewards, group, settings)
    assert tuple(advantages.shape) == tuple(rewards.shape), f"advantages of shape {tuple(advantages.shape)}"
    assert all(math.isfinite(a) for a in advantages.tolist()), f"advantages are not finite: {advantages}"

    result = check_probe(algorithm, expected_loss)
    _assert_packing_invariant(algorithm, settings)
    algorithm.verify()
    return result


def _assert_packing_invariant(algorithm: Algorithm, settings: AlgorithmSection) -> None:
    """Each probe document's per-token loss alone equals its share of the packed row."""
    import torch

    docs = [torch.tensor([ROLLOUT_LOGPROB + d for d in deltas]) for deltas in DELTAS]
    advantages = [1.5, -0.5, -0.5, -0.5]

    def row(members: list[int]) -> TokenBatch:
        logprobs = torch.cat([docs[i] for i in members])
        return TokenBatch(
            logprobs=logprobs,
            rollout_logprobs=torch.full_like(logprobs, ROLLOUT_LOGPROB),
            advantages=torch.cat([torch.full_like(docs[i], advantages[i]) for i in members]),
            mask=torch.ones_like(logprobs),
            doc_index=torch.cat([torch.full((len(docs[i]),), k, dtype=torch.long) for k, i in enumerate(members)]),
            num_docs=len(members),
        )

    packed = algorithm.policy_loss(row([0, 1, 2, 3]), settings).per_token
    alone = torch.cat([algorithm.policy_loss(row([i]), settings).per_token for i in range(4)])
    assert torch.allclose(packed, alone, atol=1e-6), (
        f"the loss of a document depends on the documents packed with it: packed {packed.tolist()}, "
        f"alone {alone.tolist()} (use TokenBatch.doc_index for per-sequence quantities)"
    )
