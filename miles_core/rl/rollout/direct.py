"""The direct rollout path: prompts tokenized once, generated in one batch, token-exact.

The engine receives ``input_ids`` and returns the sampled ids with their log-probs; nothing is
re-rendered or re-tokenized, so the trainer sees exactly what was sampled. ``engine`` is anything
with ``generate(list[GenerationRequest]) -> list[Completion]`` (the embedded engine in-process,
or its Ray actor proxy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles_core.rl.config import RolloutSection
from miles_core.rl.rollout.base import GenerationEngine, Tokenizer
from miles_core.rl.rollout.types import Trajectory, sample_seed
from miles_core.rl.tasks import Prompt

if TYPE_CHECKING:
    from miles_core.engine.base import Completion, SamplingParams


def render_prompt(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """Chat-template models get the rendered chat (:class:`~miles_core.chat_template.ChatTemplate`,
    the renderer the session server uses too); others the plain prompt text."""
    if getattr(tokenizer, "chat_template", None):
        from miles_core.chat_template import ChatTemplate

        return list(ChatTemplate.of(tokenizer).prompt_ids(prompt.chat()))
    return list(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])


class DirectRollout:
    label = "direct"

    def __init__(self, engine: GenerationEngine, tokenizer: Tokenizer, settings: RolloutSection, run_seed: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.run_seed = run_seed
        self._prompt_ids: dict[str, list[int]] = {}

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt.id not in self._prompt_ids:
            self._prompt_ids[prompt.id] = render_prompt(self.tokenizer, prompt)
        return self._prompt_ids[prompt.id]

    def sampling(self, *, greedy: bool, seed: int | None) -> SamplingParams:
        from miles_core.engine.base import SamplingParams

        s = self.settings
        if greedy:
            return SamplingParams(max_tokens=s.max_new_tokens, temperature=0.0)
        return SamplingParams(max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, seed=seed)

    def run(self, prompts: Sequence[Prompt], step: int, *, greedy: bool = False, first_index: int = 0) -> list[Trajectory]:
        """One completion per prompt (the caller repeats prompts for groups), in order.

        Sample ``i`` is seeded by ``(run seed, step, first_index + i)``: splitting a batch across
        workers (``first_index`` = the slice's offset) samples exactly the same tokens."""
        from miles_core.engine.base import GenerationRequest

        requests = [
            GenerationRequest(
                input_ids=self.prompt_ids(p),
                sampling=self.sampling(greedy=greedy, seed=None if greedy else sample_seed(self.run_seed, step, i)),
            )
            for i, p in enumerate(prompts, start=first_index)
        ]
        completions = self.engine.generate(requests)
        # decoded in two batched calls (the fast tokenizer's), not two calls per completion
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        firsts = self.tokenizer.batch_decode([c.token_ids[:1] for c in completions])
        return [self._trajectory(p, c, text, first)
                for p, c, text, first in zip(prompts, completions, texts, firsts, strict=True)]

    def close(self) -> None:
        """Nothing to stop: the engine belongs to the run."""

    def _trajectory(self, prompt: Prompt, completion: Completion, text: str, first: str) -> Trajectory:
        response = tuple(completion.token_ids)
        return Trajectory(
            prompt=prompt,
            token_ids=tuple(completion.prompt_ids) + response,
            response_length=len(response),
            loss_mask=(1,) * len(response),
            rollout_logprobs=tuple(completion.logprobs),
            completion=text,
            first_token=first,
            turns=1,
            finish_reason=completion.finish_reason,
            weight_version=completion.weight_version,
        )
