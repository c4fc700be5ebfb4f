"""The sampler draws from exactly the distribution whose log-probs it reports."""

from __future__ import annotations

import random

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.base import SamplingParams
from miles_core.engine.sampling import RowParams, filtered_logprobs, row_values, sample, uniform, uniforms

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


def test_random_streams_are_splitmix64() -> None:
    """The per-request stream is SplitMix64 (Vigna's reference outputs for seed 1234567, top 53
    bits), and the vectorised draw equals the scalar reference for any seeds and positions."""
    import numpy as np

    reference = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431]
    assert [uniform(1234567, k) for k in range(4)] == [(r >> 11) * 2.0**-53 for r in reference]
    rng = random.Random(3)
    seeds = [0, 1, 2**63 - 1, *(rng.getrandbits(63) for _ in range(61))]
    draws = [rng.randrange(10**6) for _ in seeds]
    vectorised = uniforms(np.array(seeds, dtype=np.uint64), np.array(draws, dtype=np.uint64))
    assert vectorised.tolist() == [uniform(s, d) for s, d in zip(seeds, draws)]
    assert all(0.0 <= u < 1.0 for u in vectorised)
    assert len({uniform(s, 0) for s in range(1000)}) == 1000  # neighbouring seeds: unrelated draws


def test_row_params_take_equal_and_mixed_values() -> None:
    params = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=0.0), SamplingParams(top_p=0.4)]
    vocab = 10
    mixed = RowParams(5, vocab, torch.device("cpu"))
    mixed.set([4, 0, 2], params)
    same = RowParams(5, vocab, torch.device("cpu"))
    same.set_values(range(1, 4), [row_values(params[0], vocab)] * 3)
    for rows, index, p in ((mixed, 4, params[0]), (mixed, 0, params[1]), (mixed, 2, params[2]),
                           *((same, i, params[0]) for i in (1, 2, 3))):
        t, k, top_p, greedy = row_values(p, vocab)
        assert (float(rows.temperature[index]), int(rows.top_k[index]), float(rows.top_p[index]), bool(rows.greedy[index])) \
            == (pytest.approx(t), k, pytest.approx(top_p), greedy)
    assert int(same.top_k[0]) == vocab and int(same.top_k[4]) == vocab  # rows not set keep the defaults
