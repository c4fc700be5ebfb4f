"""The built-in algorithms: GRPO, Dr. GRPO and GSPO (definitions in docs/train.md).

Descriptors only at import (plugin discovery must stay cheap); the math is in :mod:`.losses` and
loaded when an algorithm computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from miles_core.rl.algorithms.base import Aggregation, PolicyLoss, TokenBatch
    from miles_core.rl.config import AlgorithmSection

@dataclass(frozen=True)
class GRPO:
    """GRPO (Shao et al. 2024, DeepSeekMath): group-normalised rewards as advantages, PPO's
    clipped surrogate against the rollout log-probs, averaged over every trained token."""

    name: str = "grpo"
    description: str = "group-normalised advantages, PPO-clipped token ratios, token-mean loss"
    reference: str = "Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)"
    needs: frozenset[str] = frozenset({"token_ids", "loss_mask", "rollout_logprobs"})
    min_group_size: int = 2
    aggregation: Aggregation = "token-mean"
    settings: frozenset[str] = frozenset({"scale_by_std", "clip_low", "clip_high"})
    defaults: Mapping[str, float | bool] = field(default_factory=lambda: MappingProxyType({}))
    #: the probe batch's loss (miles_core.rl.algorithms.probe), as docs/train.md derives it
    probe_loss: float = 0.1673526

    def advantages(self, rewards: torch.Tensor, group_size: int, settings: AlgorithmSection) -> torch.Tensor:
        from miles_core.rl.algorithms.losses import group_advantages

        return group_advantages(rewards, group_size, scale_by_std=settings.scale_by_std)

    def policy_loss(self, batch: TokenBatch, settings: AlgorithmSection) -> PolicyLoss:
        from miles_core.rl.algorithms.base import PolicyLoss
        from miles_core.rl.algorithms.losses import clipped_policy_loss

        per_token, stats = clipped_policy_loss(
            batch.logprobs, batch.rollout_logprobs, batch.advantages, batch.mask,
            clip_low=settings.clip_low, clip_high=settings.clip_high,
        )
        return PolicyLoss(per_token, stats["clipped"])

    def verify(self) -> None:
        from miles_core.rl.algorithms.probe import check_probe

        check_probe(self, self.probe_loss)


@dataclass(frozen=True)
class DrGRPO(GRPO):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without its two
    biases -- advantages are rewards minus the group mean (no division by the group's std), and
    each sequence's summed loss is divided by the generation budget instead of its own length."""

    name: str = "dr-grpo"
    description: str = "GRPO without std scaling or length normalisation: mean-centred rewards, budget-normalised loss"
    reference: str = "Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective (arXiv:2503.20783)"
    aggregation: Aggregation = "budget"
    settings: frozenset[str] = frozenset({"clip_low", "clip_high"})
    probe_loss: float = 0.05434948

    def advantages(self, rewards: torch.Tensor, group_size: int, settings: AlgorithmSection) -> torch.Tensor:
        from miles_core.rl.algorithms.losses import group_advantages

        return group_advantages(rewards, group_size, scale_by_std=False)


@dataclass(frozen=True)
class GSPO(GRPO):
    """GSPO (Zheng et al. 2025, Qwen): GRPO's advantages with a sequence-level importance ratio
    (the geometric mean of the token ratios) clipped per sequence, averaged over sequences."""

    name: str = "gspo"
    description: str = "group-normalised advantages, clipped sequence-level ratios, sequence-mean loss"
    reference: str = "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)"
    aggregation: Aggregation = "sequence-mean"
    defaults: Mapping[str, float | bool] = field(
        default_factory=lambda: MappingProxyType({"clip_low": 3e-4, "clip_high": 4e-4})
    )
    probe_loss: float = -0.05808844

    def policy_loss(self, batch: TokenBatch, settings: AlgorithmSection) -> PolicyLoss:
        import torch

        from miles_core.rl.algorithms.base import PolicyLoss
        from miles_core.rl.algorithms.losses import sequence_ratio

        ratio = sequence_ratio(batch.logprobs, batch.rollout_logprobs, batch.mask, batch.doc_index, batch.num_docs)
        unclipped = ratio * batch.advantages
        clipped = ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high) * batch.advantages
        mask = batch.mask.to(unclipped.dtype)
        per_token = -torch.minimum(unclipped, clipped) * mask
        return PolicyLoss(per_token, (clipped < unclipped).to(unclipped.dtype) * mask)


BUILTIN_ALGORITHMS = (GRPO(), DrGRPO(), GSPO())
