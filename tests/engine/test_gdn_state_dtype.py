"""``EngineConfig.gdn_state_dtype``: the Gated DeltaNet recurrent states stored in bf16.

The update still computes in fp32; storing rounds each state once per token (relative error
<= 2^-9), where a bf16 model rounds every activation of every layer. So the tokens' log-probs
may move, but by far less than running the same model in bf16 moves them (measured on the tiny
preset: 1.3e-5 against 1.9e-3 mean over 1,024 greedy tokens): the bound below is a tenth of the
bf16 model's deviation, and a state that were not written back, or not rounded at all, fails it.
"""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.engine import gdn_ops
from miles_core.engine.base import Completion, GenerationRequest, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig
from miles_core.errors import ConfigError

register_cpu_ci(est_time=8, suite="stage-a-cpu")


def test_the_config_names_the_field_the_choices_and_the_runner() -> None:
    with pytest.raises(ConfigError, match=r"gdn_state_dtype must be one of float32, bfloat16, got 'float16'"):
        EngineConfig(gdn_state_dtype="float16")
    with pytest.raises(ConfigError, match="gdn_state_dtype applies to the lean runner"):
        EngineConfig(gdn_state_dtype="bfloat16", runner="hf")


def test_a_bf16_state_is_updated_in_fp32_and_rounded_once() -> None:
    gen = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv = 3, 2, 4, 16, 8
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v, g = torch.randn(n, hv, dv, generator=gen), -torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen)
    stored = torch.randn(n, hv, dk, dv, generator=gen).bfloat16()
    wide = stored.float()
    eps, sqrt_dk = torch.tensor(1e-6), torch.tensor(dk**0.5)
    out = gdn_ops.recurrent_decode(q, k, v, g, beta, stored, eps, sqrt_dk)
    expected = gdn_ops.recurrent_decode(q, k, v, g, beta, wide, eps, sqrt_dk)
    assert stored.dtype == torch.bfloat16
    assert torch.equal(out, expected)  # the output comes from the fp32 state, before rounding
    assert torch.equal(stored, wide.bfloat16())
    assert not torch.equal(stored.float(), wide)  # it was rounded: fp32 would keep these bits


def _greedy(tiny_dir, prompts: list[list[int]], dtype: str, state_dtype: str) -> list[Completion]:
    config = EngineConfig(max_batch_size=len(prompts), dtype=dtype, gdn_state_dtype=state_dtype)
    with Engine.from_pretrained(tiny_dir, config) as engine:
        assert engine.runner_info()["gdn_state_dtype"] == state_dtype
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        return engine.generate([GenerationRequest(p, params) for p in prompts])


def _deviation(reference: list[Completion], other: list[Completion]) -> float:
    """Mean |delta log p| over the tokens both runs share (up to the first differing token)."""
    deltas = []
    for a, b in zip(reference, other):
        for token_a, token_b, logprob_a, logprob_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if token_a != token_b:
                break
            deltas.append(abs(logprob_a - logprob_b))
    assert len(deltas) >= 200, "too few shared tokens to compare"
    return statistics.mean(deltas)


def test_a_bf16_state_moves_log_probs_far_less_than_a_bf16_model(tiny_dir) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(200) for _ in range(rng.randint(4, 40))] for _ in range(8)]
    reference = _greedy(tiny_dir, prompts, "float32", "float32")
    bf16_state = _deviation(reference, _greedy(tiny_dir, prompts, "float32", "bfloat16"))
    bf16_model = _deviation(reference, _greedy(tiny_dir, prompts, "bfloat16", "float32"))
    assert 0 < bf16_state <= bf16_model / 10, (bf16_state, bf16_model)
