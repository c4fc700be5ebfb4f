"""The direct rollout's per-step work: seeds, shared sampling parameters, cached token decoding."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_core.ci.register import register_cpu_ci
from miles_core.engine.base import Completion, GenerationRequest
from miles_core.rl.config import RolloutSection
from miles_core.rl.rollout.direct import DirectRollout
from miles_core.rl.rollout.types import sample_seed, sample_seeds
from miles_core.rl.tasks import Prompt

register_cpu_ci(est_time=4, suite="stage-a-cpu")


@dataclass
class FixedEngine:
    """Answers request ``i`` of a call with ``outputs[i % len(outputs)]``; records the requests."""

    outputs: list[tuple[int, ...]]
    weight_version: str = "0"
    requests: list[GenerationRequest] = field(default_factory=list)

    def generate(self, requests):
        self.requests = list(requests)
        return [Completion(str(i), tuple(r.input_ids), self.outputs[i % len(self.outputs)], (-0.5,) * len(self.outputs[i % len(self.outputs)]),
                           "length", None, self.weight_version, r.sampling.seed or 0) for i, r in enumerate(requests)]

    def update_weights(self, weights, version):
        return version


def test_sample_seeds_are_sample_seed() -> None:
    assert sample_seeds(7, 3, 40, 300) == [sample_seed(7, 3, i) for i in range(40, 340)]
    assert sample_seeds(0, 0, 0, 0) == []


def test_decoded_texts_equal_decoding_each_completion() -> None:
    """One-token completions and first tokens come from a cache: they must equal decoding each
    completion on its own -- special tokens, a lone UTF-8 lead byte, empty and longer completions."""
    from miles_core.assets.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    accented = tuple(tokenizer("é!", add_special_tokens=False)["input_ids"])
    assert len(accented) == 3  # two bytes of one character, then "!"
    eos = tokenizer.eos_token_id
    outputs = [(eos,), accented[:1], accented, (), (eos, accented[2]), tuple(tokenizer("ab", add_special_tokens=False)["input_ids"])]
    engine = FixedEngine(outputs)
    rollout = DirectRollout(engine, tokenizer, RolloutSection(max_new_tokens=4), run_seed=5)
    prompts = [Prompt(id=f"p{i}", text=f"{i}+1=", answer=str(i + 1)) for i in range(3)]
    batch = [p for p in prompts for _ in range(4)]
    for step in (0, 1):  # cold cache, then warm
        trajectories = rollout.run(batch, step, first_index=2)
        for i, trajectory in enumerate(trajectories):
            ids = list(outputs[i % len(outputs)])
            assert trajectory.completion == tokenizer.decode(ids, skip_special_tokens=True)
            assert trajectory.first_token == tokenizer.decode(ids[:1])
            assert trajectory.token_ids[len(trajectory.token_ids) - trajectory.response_length :] == tuple(ids)
        seeds = [r.sampling.seed for r in engine.requests]
        assert seeds == [sample_seed(5, step, 2 + i) for i in range(len(batch))]
        assert len({r.sampling.max_tokens for r in engine.requests}) == 1


def test_greedy_runs_share_unseeded_parameters() -> None:
    from miles_core.assets.char_model import build_char_tokenizer

    engine = FixedEngine([(5,)])
    rollout = DirectRollout(engine, build_char_tokenizer(), RolloutSection(max_new_tokens=2), run_seed=0)
    rollout.run([Prompt(id="a", text="1+1=", answer="2")] * 3, 0, greedy=True)
    assert all(r.sampling.seed is None and r.sampling.greedy for r in engine.requests)
    assert len({id(r.sampling) for r in engine.requests}) == 1
