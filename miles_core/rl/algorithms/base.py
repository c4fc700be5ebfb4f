"""The algorithm protocol: what a ``miles_algorithms`` contribution declares and computes.

An algorithm is the part of the RL step a researcher changes: how rewards become advantages and
how a sampled token's log-probs and advantage become a loss. The loop owns everything else
(packing, the entropy bonus, the KL penalty to the initial policy, minibatches, gradient
clipping), so a new algorithm is two small functions plus its declarations.

Per step the loop calls ``advantages(rewards, group_size, settings)`` once, then for every packed
row ``policy_loss(batch, settings)``; the per-token losses (plus the loop's entropy and KL terms)
are summed with the weights of the algorithm's :data:`Aggregation` over the minibatch.

Nothing here imports torch (plugin discovery imports this module); tensors are torch tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from miles_core.rl.config import AlgorithmSection

#: what a rollout function may provide and an algorithm may need, with what each promises
ROLLOUT_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "token_ids": "prompt and response token ids exactly as the engine sampled them",
        "loss_mask": "1 for response tokens the policy generated, 0 for observation (tool) tokens",
        "rollout_logprobs": "the sampler's log-prob of each generated token (what importance ratios divide by)",
    }
)

#: how per-token losses become the minibatch's loss (see
#: :func:`miles_core.rl.algorithms.losses.aggregation_weights`)
Aggregation = Literal["token-mean", "sequence-mean", "budget"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "sequence-mean", "budget")

#: ``algorithm.*`` settings the loop itself reads for every algorithm; an algorithm's
#: ``settings`` names the others it reads
SHARED_SETTINGS: frozenset[str] = frozenset(
    {"name", "lr", "weight_decay", "kl_coef", "kl_bias_correction", "entropy_coef", "epochs", "minibatches",
         "max_grad_norm"}
)


@dataclass(frozen=True)
class TokenBatch:
    """One packed row's per-token tensors, all ``[T]``, as the policy loss sees them."""

    logprobs: torch.Tensor  # the trainer's log-prob of each target; carries the gradient
    rollout_logprobs: torch.Tensor  # the sampler's log-prob of the same target (0 where untrained)
    advantages: torch.Tensor  # the owning document's advantage, at each of its positions
    mask: torch.Tensor  # float 0/1: the position predicts a trained token
    doc_index: torch.Tensor  # long: which document of the row owns the position
    num_docs: int


@dataclass(frozen=True)
class PolicyLoss:
    """The policy-gradient term of one row, before aggregation."""

    per_token: torch.Tensor  # [T] loss of each position (0 where the mask is 0)
    clipped: torch.Tensor  # [T] 1 where the ratio was clipped (reported as clip_fraction)


@runtime_checkable
class Algorithm(Protocol):
    """An RL algorithm contributed through ``miles_algorithms``."""

    #: unique name; ``algorithm.name`` selects it
    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    #: the paper or document that defines it (docs/train.md restates the definition)
    @property
    def reference(self) -> str: ...
    #: keys of :data:`ROLLOUT_FIELDS` its loss reads; the selected rollout function must provide them
    @property
    def needs(self) -> frozenset[str]: ...
    #: the smallest ``rollout.samples_per_prompt`` it works with (group-relative estimators: 2)
    @property
    def min_group_size(self) -> int: ...
    #: how per-token losses are aggregated over a minibatch
    @property
    def aggregation(self) -> Aggregation: ...
    #: ``algorithm.*`` settings it reads besides :data:`SHARED_SETTINGS` (setting another one away
    #: from its default is a config error naming the algorithms that read it)
    @property
    def settings(self) -> frozenset[str]: ...
    #: its own defaults for settings no config layer sets (GSPO's clip range, say)
    @property
    def defaults(self) -> Mapping[str, float | bool]: ...

    def advantages(self, rewards: torch.Tensor, group_size: int, settings: AlgorithmSection) -> torch.Tensor:
        """Per-sample advantages ``[N]`` from rewards ``[N]`` (groups of ``group_size`` contiguous)."""
        ...

    def policy_loss(self, batch: TokenBatch, settings: AlgorithmSection) -> PolicyLoss:
        """The per-token policy-gradient loss of one packed row."""
        ...

    def verify(self) -> None:
        """Raise unless the loss on the probe batch has the documented value and gradient signs."""
        ...
