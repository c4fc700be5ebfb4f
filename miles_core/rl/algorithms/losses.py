"""The RL math the built-in algorithms share: advantages, ratios, the clipped surrogate, KL,
entropy, and how per-token losses are aggregated into a minibatch's loss.

Every per-token tensor is ``[T]`` over one packed row (:class:`~.batch.PackedRow`), token-aligned
the way a causal LM predicts: position ``t`` carries the log-prob of token ``t + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_core.rl.algorithms.base import Aggregation


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward minus its group's mean (divided by the group's std when asked).

    ``rewards`` is flat ``[n_groups * group_size]``, groups contiguous. A group whose rewards are
    all equal gets zero advantages (no signal, no noise).
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centred.view(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of each target under ``softmax(logits / temperature)``, computed in fp32.

    ``targets`` may hold ``-100`` (ignored positions); their log-prob is 0.
    """
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    safe = targets.clamp(min=0)
    out = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return out.masked_fill(targets < 0, 0.0)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference), per token, always >= 0."""
    log_ratio = ref_logprobs - logprobs
    return log_ratio.exp() - log_ratio - 1


def clipped_policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate against the log-probs the rollout sampled with.

    Returns the per-token loss (masked positions 0) and per-token stats (``clipped`` fraction).
    """
    ratio = (logprobs - rollout_logprobs).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    mask = mask.to(loss.dtype)
    return loss * mask, {"clipped": (clipped < unclipped).to(loss.dtype) * mask, "ratio": ratio}




def sequence_ratio(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                   doc_index: torch.Tensor, num_docs: int) -> torch.Tensor:
    """GSPO's sequence-level importance ratio at every position of its document, in the
    "GSPO-token" form: ``sg[s_i] * pi(y_t) / sg[pi(y_t)]`` with
    ``s_i = exp(mean_t log(pi / pi_old))`` over the document's trained tokens.

    Its value at every token of document ``i`` is ``s_i``; its gradient is ``s_i`` times the
    gradient of that token's log-prob, so the gradient of a sum over the document is ``s_i`` times
    the document's mean log-prob gradient when the sum is divided by the document's length.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - rollout_logprobs) * mask
    per_doc = torch.zeros(num_docs, dtype=logprobs.dtype, device=logprobs.device)
    lengths = torch.zeros_like(per_doc).index_add_(0, doc_index, mask)
    per_doc = per_doc.index_add(0, doc_index, log_ratio.detach()) / lengths.clamp(min=1.0)
    return (per_doc[doc_index] + logprobs - logprobs.detach()).exp()


@dataclass(frozen=True)
class MinibatchTotals:
    """What aggregation divides by, counted over the whole minibatch (every data-parallel rank)."""

    tokens: float  # trained tokens
    sequences: float  # documents with at least one trained token
    budget: float  # the generation budget of one sequence (rollout.max_new_tokens x max_turns)


def aggregation_weights(aggregation: Aggregation, mask: torch.Tensor, doc_index: torch.Tensor, num_docs: int,
                        totals: MinibatchTotals) -> torch.Tensor:
    """Per-token weights ``w`` such that the minibatch's loss is ``sum_t w_t * loss_t``.

    * ``token-mean``: every trained token of the minibatch counts the same, ``1 / tokens``.
    * ``sequence-mean``: each sequence's mean over its tokens, averaged over sequences:
      ``1 / (len_i * sequences)``.
    * ``budget``: each sequence's sum divided by the generation budget, averaged over sequences:
      ``1 / (budget * sequences)`` -- a constant, so no length bias (Dr. GRPO).
    """
    mask = mask.to(torch.float32)
    if aggregation == "token-mean":
        return mask / totals.tokens
    if aggregation == "budget":
        return mask / (totals.budget * totals.sequences)
    if aggregation == "sequence-mean":
        lengths = torch.zeros(num_docs, dtype=mask.dtype, device=mask.device).index_add_(0, doc_index, mask)
        return mask / (lengths[doc_index].clamp(min=1.0) * totals.sequences)
    raise ValueError(f"unknown aggregation {aggregation!r} (known: token-mean, sequence-mean, budget)")
