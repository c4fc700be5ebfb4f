"""One policy update over a step's documents, shared by every trainer backend.

A backend supplies ``forward(row) -> logits [T, vocab]`` (and optionally a frozen reference
forward for the KL penalty); this module owns minibatching, packing, the loss and its
normalisation, gradient clipping and the statistics every run reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from miles_core.rl.algorithms import (
    PackedRow,
    TrainDocument,
    clipped_policy_loss,
    entropy_from_logits,
    kl_k3,
    pack_documents,
    token_logprobs,
)
from miles_core.rl.config import AlgorithmSection

Forward = Callable[[PackedRow], torch.Tensor]


@dataclass(frozen=True)
class UpdateSettings:
    algorithm: AlgorithmSection
    temperature: float
    max_tokens_per_row: int
    packing: bool


def split_minibatches(docs: Sequence[TrainDocument], n: int) -> list[list[TrainDocument]]:
    """``n`` contiguous, nearly equal slices (order kept: groups stay together when they fit)."""
    size, extra = divmod(len(docs), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(list(docs[start:end]))
        start = end
    return [mb for mb in out if mb]


def policy_update(
    docs: Sequence[TrainDocument],
    forward: Forward,
    optimizer: torch.optim.Optimizer,
    params: Iterable[torch.nn.Parameter],
    settings: UpdateSettings,
    *,
    reference: Forward | None = None,
    extra_loss: Callable[[PackedRow], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Epochs x minibatches optimizer steps; returns the step's training statistics.

    ``logprob_mismatch_*`` compares the trainer's log-probs with the rollout's on the first
    minibatch of the first epoch, before any weight moved: the same weights on both sides, so it
    measures only numerics (packing leaks, dtype, kernel differences).
    ``extra_loss(row)`` adds a backend's auxiliary loss (MTP), already scaled.
    """
    algo = settings.algorithm
    params = [p for p in params if p.requires_grad]
    sums: dict[str, float] = {}
    mismatch_max, mismatch_sum, mismatch_n = 0.0, 0.0, 0
    grad_norms: list[float] = []
    updates = 0
    for epoch in range(algo.epochs):
        for mb_index, minibatch in enumerate(split_minibatches(docs, algo.minibatches)):
            rows = pack_documents(minibatch, settings.max_tokens_per_row, packing=settings.packing)
            n_tokens = sum(float(r.loss_mask.sum()) for r in rows)
            if n_tokens == 0:
                continue
            optimizer.zero_grad(set_to_none=True)
            for row in rows:
                logits = forward(row)
                device = logits.device
                targets = row.targets.to(device)
                mask = row.loss_mask.to(device)
                rollout_lp = row.rollout_logprobs.to(device)
                logprobs = token_logprobs(logits, targets, settings.temperature)
                per_token, stats = clipped_policy_loss(
                    logprobs, rollout_lp, row.advantages.to(device), mask,
                    clip_low=algo.clip_low, clip_high=algo.clip_high,
                )
                entropy = entropy_from_logits(logits, settings.temperature)
                loss = per_token.sum()
                if algo.entropy_coef:
                    loss = loss - algo.entropy_coef * (entropy * mask).sum()
                if reference is not None and algo.kl_coef:
                    with torch.no_grad():
                        ref_lp = token_logprobs(reference(row), targets, settings.temperature)
                    kl_ref = kl_k3(logprobs, ref_lp) * mask
                    loss = loss + algo.kl_coef * kl_ref.sum()
                    _add(sums, "kl_ref", float(kl_ref.detach().sum()))
                loss = loss / n_tokens
                if extra_loss is not None:
                    loss = loss + extra_loss(row) / len(rows)
                loss.backward()
                with torch.no_grad():
                    diff = (logprobs.detach() - rollout_lp).abs() * mask
                    if epoch == 0 and mb_index == 0:
                        mismatch_max = max(mismatch_max, float(diff.max()))
                        mismatch_sum += float(diff.sum())
                        mismatch_n += int(mask.sum())
                    _add(sums, "loss", float(loss.detach()) * n_tokens)
                    _add(sums, "entropy", float((entropy.detach() * mask).sum()))
                    _add(sums, "approx_kl", float((kl_k3(logprobs.detach(), rollout_lp) * mask).sum()))
                    _add(sums, "clip_fraction", float(stats["clipped"].sum()))
                    _add(sums, "trained_tokens", float(mask.sum()))
                    _add(sums, "row_tokens", float(row.num_tokens))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, algo.max_grad_norm)
            grad_norms.append(float(grad_norm))
            optimizer.step()
            updates += 1
    trained = max(sums.get("trained_tokens", 0.0), 1.0)
    out = {
        "loss": sums.get("loss", 0.0) / trained,
        "entropy": sums.get("entropy", 0.0) / trained,
        "approx_kl": sums.get("approx_kl", 0.0) / trained,
        "clip_fraction": sums.get("clip_fraction", 0.0) / trained,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "logprob_mismatch_max": mismatch_max,
        "logprob_mismatch_mean": mismatch_sum / max(mismatch_n, 1),
        "optimizer_steps": float(updates),
        "train_tokens": sums.get("row_tokens", 0.0),
    }
    if reference is not None and algo.kl_coef:
        out["kl_ref"] = sums.get("kl_ref", 0.0) / trained
    return out


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value
