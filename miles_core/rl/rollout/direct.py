"""The direct rollout path: prompts tokenized once, generated in one batch, token-exact.

The engine receives ``input_ids`` and returns the sampled ids with their log-probs; nothing is
re-rendered or re-tokenized, so the trainer sees exactly what was sampled. ``engine`` is anything
with ``generate(list[GenerationRequest]) -> list[Completion]`` (the embedded engine in-process,
or its Ray actor proxy).

A step's work around the engine is kept per distinct thing, not per sample: prompts are
tokenized once per run, the sampling parameters built once per run (each sample gets a copy with
its seed), and one-token completions -- and every completion's first token -- are decoded once
per distinct token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles_core.rl.config import RolloutSection
from miles_core.rl.rollout.base import GenerationEngine, Tokenizer
from miles_core.rl.rollout.types import Trajectory, sample_seeds
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
        self._params: dict[bool, SamplingParams] = {}  # by greedy
        #: token id -> (decoded without special tokens, decoded as is): at most the vocabulary
        self._token_text: dict[int, tuple[str, str]] = {}

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

        params = self._params.get(greedy)
        if params is None:
            params = self._params[greedy] = self.sampling(greedy=greedy, seed=None)
        if greedy:
            requests = [GenerationRequest(self.prompt_ids(p), params) for p in prompts]
        else:
            seeds = sample_seeds(self.run_seed, step, first_index, len(prompts))
            requests = [GenerationRequest(self.prompt_ids(p), params.with_seed(seed)) for p, seed in zip(prompts, seeds)]
        completions = self.engine.generate(requests)
        texts, firsts = self._decode(completions)
        return [self._trajectory(p, c, text, first)
                for p, c, text, first in zip(prompts, completions, texts, firsts, strict=True)]

    def _decode(self, completions: Sequence[Completion]) -> tuple[list[str], list[str]]:
        """Each completion decoded without special tokens, and its first token decoded as is.

        A token decodes on its own the same whatever the batch, so single tokens come from a cache
        filled by one batched call per missing set; longer completions are decoded in one batched
        call (the fast tokenizer's)."""
        cache = self._token_text
        missing = list({c.token_ids[0] for c in completions if c.token_ids and c.token_ids[0] not in cache})
        if missing:
            plain = self.tokenizer.batch_decode([[t] for t in missing], skip_special_tokens=True)
            raw = self.tokenizer.batch_decode([[t] for t in missing])
            cache.update(zip(missing, zip(plain, raw)))
        texts: list[str | None] = []
        firsts: list[str] = []
        longer: list[int] = []
        for i, completion in enumerate(completions):
            ids = completion.token_ids
            if not ids:
                texts.append("")
                firsts.append("")
                continue
            entry = cache[ids[0]]
            firsts.append(entry[1])
            if len(ids) == 1:
                texts.append(entry[0])
            else:
                texts.append(None)
                longer.append(i)
        if longer:
            decoded = self.tokenizer.batch_decode([completions[i].token_ids for i in longer], skip_special_tokens=True)
            for i, text in zip(longer, decoded):
                texts[i] = text
        return texts, firsts  # type: ignore[return-value]  # each None was a longer completion, filled above

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
