"""The sampler draws from exactly the distribution whose log-probs it reports."""

from __future__ import annotations

import random

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.base import SamplingParams
from miles_core.engine.sampling import filtered_logprobs, sample

register_cpu_ci(est_time=6, suite="stage-a-cpu")

LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, -1.0, 0.9])


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3, top_p=0.8),
     SamplingParams(temperature=0.9, top_k=4, top_p=0.7)],
    ids=["plain", "t0.7-k3", "t1.3-p0.8", "t0.9-k4-p0.7"],
)
def test_empirical_frequencies_match_the_reported_distribution(params: SamplingParams) -> None:
    n = 40_000
    rng = random.Random(0)
    tokens, logprobs = sample(LOGITS.expand(n, -1), [params] * n, [rng.random() for _ in range(n)])
    reported = filtered_logprobs(LOGITS[None], [params])[0]
    frequencies = torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()).double() / n
    assert (frequencies - reported.exp().double()).abs().max() < 0.01
    assert all(reported[t] > float("-inf") for t in set(tokens))  # filtered tokens are never drawn
    assert logprobs == [float(reported[t]) for t in tokens]


def test_filters_keep_what_the_rules_say() -> None:
    kept = lambda p: (filtered_logprobs(LOGITS[None], [p])[0] > float("-inf")).nonzero().flatten().tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_p=1e-6)) == [0]  # the token that crosses the threshold stays
    probabilities = LOGITS.softmax(-1)
    assert float(probabilities[0]) < 0.5 < float(probabilities[:2].sum())
    assert kept(SamplingParams(top_p=0.5)) == [0, 1]
    assert kept(SamplingParams(temperature=0.0, top_k=1)) == list(range(LOGITS.numel()))  # greedy: unmodified


def test_greedy_picks_the_argmax_and_reports_the_model_log_prob() -> None:
    tokens, logprobs = sample(LOGITS[None], [SamplingParams(temperature=0.0)], [0.999])
    assert tokens == [0]
    assert logprobs[0] == pytest.approx(float(LOGITS.log_softmax(-1)[0]))


def test_rows_with_different_parameters_sample_as_if_alone() -> None:
    """One batched draw over rows with different temperature / top-k / top-p / greedy settings gives
    each row exactly what it gets alone (the filter's sort runs for every row once any row filters)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=5),
              SamplingParams(top_p=0.3), SamplingParams(temperature=2.0, top_k=10, top_p=0.8), SamplingParams(top_k=-1)]
    rng = random.Random(1)
    for _ in range(20):
        uniforms = [rng.random() for _ in params]
        tokens, logprobs = sample(logits, params, uniforms)
        for i, (p, u) in enumerate(zip(params, uniforms)):
            alone_tokens, alone_logprobs = sample(logits[i : i + 1], [p], [u])
            assert alone_tokens == [tokens[i]]
            assert alone_logprobs == pytest.approx([logprobs[i]], abs=1e-6)
