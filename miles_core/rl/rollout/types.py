"""What a rollout produces: token-exact trajectories."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles_core.frozen import quick_init
from miles_core.rl.tasks import Prompt, RewardInput

if TYPE_CHECKING:
    from miles_core.rl.algorithms.batch import TrainDocument


@quick_init
@dataclass(frozen=True)
class Trajectory:
    """One sampled episode, exactly as the engine produced it.

    ``token_ids`` is prompt + response; the response is its last ``response_length`` tokens
    (generated tokens with ``loss_mask`` 1, tool/observation tokens with 0);
    ``rollout_logprobs`` has one entry per response token (0 where the mask is 0).
    """

    prompt: Prompt
    token_ids: tuple[int, ...]
    response_length: int
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    completion: str  # the last generated turn, decoded without special tokens
    first_token: str  # the first generated token, decoded
    turns: int
    finish_reason: str
    weight_version: str

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    def reward_input(self) -> RewardInput:
        return RewardInput(
            prompt_id=self.prompt.id,
            prompt=self.prompt.text,
            answer=self.prompt.answer,
            completion=self.completion,
            first_token=self.first_token,
            turns=self.turns,
        )

    def document(self, advantage: float) -> TrainDocument:
        from miles_core.rl.algorithms.batch import TrainDocument

        return TrainDocument(self.token_ids, self.response_length, self.loss_mask, self.rollout_logprobs, advantage)


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """The sampling seed of sample ``index`` of ``step``: independent of batching and workers."""
    digest = hashlib.blake2b(f"{run_seed}/{step}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def sample_seeds(run_seed: int, step: int, first_index: int, count: int) -> list[int]:
    """``sample_seed(run_seed, step, first_index + i)`` for ``i < count``: the hash of the common
    prefix is computed once and copied (the same digests, ~2x faster for a step's batch)."""
    prefix = hashlib.blake2b(f"{run_seed}/{step}/".encode(), digest_size=8)
    seeds = []
    for index in range(first_index, first_index + count):
        h = prefix.copy()
        h.update(str(index).encode())
        seeds.append(int.from_bytes(h.digest(), "big") >> 1)
    return seeds
