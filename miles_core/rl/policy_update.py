"""One policy update over a step's documents, shared by every trainer backend.

A backend supplies ``forward(row) -> logits`` at the row's trained targets (``[K, vocab]``, the
rows of ``row.positions``; logits at every position, ``[T, vocab]``, are gathered here) and
optionally a frozen reference forward for the KL penalty; the algorithm (:class:`~miles_core.rl.algorithms.base.Algorithm`)
supplies the per-token policy loss and how it is aggregated; this module owns minibatching,
packing, the entropy and KL terms, normalisation, gradient clipping and the statistics every run
reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from miles_core.rl.algorithms.base import Algorithm, TokenBatch
from miles_core.rl.algorithms.batch import PackedRow, TrainDocument, merge_duplicates, pack_documents
from miles_core.rl.algorithms.losses import (
    MinibatchTotals,
    aggregation_weights,
    entropy_from_logits,
    kl_k3,
    token_logprobs,
)
from miles_core.rl.config import AlgorithmSection, TrainConfig

Forward = Callable[[PackedRow], torch.Tensor]


@dataclass(frozen=True)
class UpdateSettings:
    """What one update needs besides the model: the algorithm, its settings and the row layout.

    ``budget`` is one sequence's generation budget (``rollout.max_new_tokens`` x
    ``rollout.max_turns``), which the ``budget`` aggregation divides by.
    """

    algorithm: AlgorithmSection
    temperature: float
    max_tokens_per_row: int
    packing: bool
    method: Algorithm | None = None  # None: GRPO
    budget: float = 1.0
    #: lay out a group's documents after one copy of their common prompt (the backend's model must
    #: honour ``PackedRow.branches``)
    share_prompts: bool = False
    #: train identical samples of a minibatch once, weighted by their number (the same update;
    #: :func:`~miles_core.rl.algorithms.batch.merge_duplicates`); off for a backend whose forward
    #: adds a loss of the row's own (megatron's MTP), which would count each sample once
    merge_duplicates: bool = True

    @classmethod
    def from_config(cls, config: TrainConfig, algorithm: Algorithm, *, packing: bool | None = None,
                    share_prompts: bool = False, merge_duplicates: bool = True) -> UpdateSettings:
        return cls(
            algorithm=config.algorithm,
            temperature=config.rollout.temperature,
            max_tokens_per_row=config.trainer.max_tokens_per_row,
            packing=config.trainer.packing if packing is None else packing,
            method=algorithm,
            budget=float(config.rollout.max_new_tokens * config.rollout.max_turns),
            share_prompts=share_prompts,
            merge_duplicates=merge_duplicates,
        )

    @property
    def objective(self) -> Algorithm:
        if self.method is not None:
            return self.method
        from miles_core.rl.algorithms.builtin import GRPO

        return GRPO()


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the data-parallel ranks of a sharded trainer (FSDP2).

    Every rank gets the step's *whole* document list and computes the same deterministic split,
    so the ranks agree on the token count that normalises the loss and on the number of rows each
    runs without exchanging anything but the final statistics.
    """

    rank: int
    world_size: int
    #: this rank's device; the process group's backend (the hardware backend's) reduces tensors there
    device: torch.device = torch.device("cpu")  # noqa: RUF009 (an immutable value)

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return tensor.tolist()


def shard_documents(docs: Sequence[TrainDocument], world_size: int) -> list[list[TrainDocument]]:
    """Documents to ranks, longest first onto the least-loaded rank (deterministic, token-balanced)."""
    order = sorted(range(len(docs)), key=lambda i: (-len(docs[i].token_ids), i))
    shards: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in order:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(i)
        loads[rank] += len(docs[i].token_ids)
    return [[docs[i] for i in sorted(members)] for members in shards]


def _rows_for_rank(
    minibatch: Sequence[TrainDocument], settings: UpdateSettings, dp: DataParallel | None
) -> tuple[list[PackedRow], MinibatchTotals, int]:
    """This rank's rows, the minibatch's totals over all ranks (every copy a document stands for
    counted), and how many rows are real.

    With data parallelism every rank runs as many rows as the busiest one (FSDP's forward and
    backward are collectives); the extra rows are copies of a real row with the loss mask zeroed.
    """
    totals = MinibatchTotals(
        tokens=float(sum(sum(d.loss_mask) * d.multiplicity for d in minibatch)),
        sequences=float(sum(d.multiplicity for d in minibatch if any(d.loss_mask))),
        budget=settings.budget,
    )
    if dp is None:
        rows = pack_documents(minibatch, settings.max_tokens_per_row, packing=settings.packing,
                              share_prompts=settings.share_prompts)
        return rows, totals, len(rows)
    per_rank = [
        pack_documents(shard, settings.max_tokens_per_row, packing=settings.packing,
                       share_prompts=settings.share_prompts) if shard else []
        for shard in shard_documents(minibatch, dp.world_size)
    ]
    rows = per_rank[dp.rank]
    real = len(rows)
    filler = next(r for rows_ in per_rank for r in rows_)
    filler = replace(filler, loss_mask=torch.zeros_like(filler.loss_mask))
    return rows + [filler] * (max(len(r) for r in per_rank) - real), totals, real


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
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """Epochs x minibatches optimizer steps; returns the step's training statistics.

    ``logprob_mismatch_*`` compares the trainer's log-probs with the rollout's on the first
    minibatch of the first epoch, before any weight moved: the same weights on both sides, so it
    measures only numerics (packing leaks, dtype, kernel differences). ``logprob_mismatch_kl`` is
    KL(rollout || trainer) there, estimated with k3 on the sampled tokens (they were drawn from
    the rollout's distribution, which makes the estimate unbiased).
    ``extra_loss(row)`` adds a backend's auxiliary loss (MTP), already scaled; identical documents
    are merged (``settings.merge_duplicates``) only without it, since such a loss is the row's own.

    The minibatch's loss is ``sum_t w_t * (policy_t - entropy_coef * entropy_t + kl_coef * kl_t)``
    with the per-token policy loss of the algorithm, ``kl_t`` the k3 KL to the reference (times the
    token's importance ratio to the rollout with ``kl_bias_correction``) and the weights ``w`` of its aggregation
    (``token-mean``: one over the minibatch's trained tokens). ``loss`` in the statistics is that
    objective per trained token (times the trained tokens of its minibatch, summed, over all
    trained tokens: for ``token-mean``, the mean per-token loss).

    With ``dp`` (an FSDP2-sharded model on every rank), each rank trains its share of every
    minibatch; the weights use the minibatch's totals over all ranks and the loss is scaled by
    the world size (FSDP averages gradients over ranks), so the gradients and statistics equal a
    single process's on the whole minibatch.
    """
    algo = settings.algorithm
    method = settings.objective
    params = [p for p in params if p.requires_grad]
    sums: dict[str, float] = {}
    mismatch_max, mismatch_sum, mismatch_kl, mismatch_n = 0.0, 0.0, 0.0, 0
    grad_norms: list[float] = []
    updates = 0
    minibatches = split_minibatches(docs, algo.minibatches)
    if settings.merge_duplicates and extra_loss is None:
        # identical documents laid out once, their rows carrying the multiplicity
        minibatches = [merge_duplicates(minibatch) for minibatch in minibatches]
    merged = len(docs) - sum(len(minibatch) for minibatch in minibatches)  # trained through a copy
    layouts = [_rows_for_rank(minibatch, settings, dp) for minibatch in minibatches]  # the same every epoch
    for epoch in range(algo.epochs):
        for mb_index, (rows, totals, real_rows) in enumerate(layouts):
            if totals.tokens == 0:
                continue
            world = dp.world_size if dp else 1
            scale = world / totals.tokens  # turns the objective back into per-token sums for the stats
            optimizer.zero_grad(set_to_none=True)
            for row_index, row in enumerate(rows):
                logits = _at_targets(forward(row), row)
                device = logits.device
                targets = row.targets.to(device)
                mask = row.loss_mask.to(device)
                copies = row.multiplicity.to(device) if row.multiplicity is not None else None
                tally = mask if copies is None else mask * copies  # the samples each target stands for
                rollout_lp = row.rollout_logprobs.to(device)
                doc_index = row.doc_index.to(device)
                logprobs = token_logprobs(logits, targets, settings.temperature)
                batch = TokenBatch(logprobs, rollout_lp, row.advantages.to(device), mask, doc_index, row.num_docs)
                policy = method.policy_loss(batch, algo)
                entropy = entropy_from_logits(logits, settings.temperature)
                per_token = policy.per_token
                if algo.entropy_coef:
                    per_token = per_token - algo.entropy_coef * entropy * mask
                if reference is not None and algo.kl_coef:
                    with torch.no_grad():
                        ref_lp = token_logprobs(_at_targets(reference(row), row), targets, settings.temperature)
                    kl_ref = kl_k3(logprobs, ref_lp) * mask
                    # k3's own gradient is biased for the reverse KL; weighted by the ratio to the
                    # sampling policy (value 1 on-policy, gradient that of the log-prob) it is not
                    kl_term = kl_ref * (logprobs - rollout_lp).exp() if algo.kl_bias_correction else kl_ref
                    per_token = per_token + algo.kl_coef * kl_term
                    _add(sums, "kl_ref", float((kl_ref.detach() * tally).sum()))
                weights = aggregation_weights(method.aggregation, mask, doc_index, row.num_docs, totals)
                if copies is not None:
                    weights = weights * copies
                loss = (per_token * weights).sum() * world
                if extra_loss is not None:
                    loss = loss + extra_loss(row) / len(rows)
                loss.backward()
                with torch.no_grad():
                    diff = (logprobs.detach() - rollout_lp).abs() * mask
                    if epoch == 0 and mb_index == 0:
                        mismatch_max = max(mismatch_max, float(diff.max()))
                        mismatch_sum += float((diff * tally).sum())
                        mismatch_kl += float((kl_k3(rollout_lp, logprobs.detach()) * tally).sum())
                        mismatch_n += int(tally.sum())
                    _add(sums, "loss", float(loss.detach()) / scale)
                    _add(sums, "entropy", float((entropy.detach() * tally).sum()))
                    _add(sums, "approx_kl", float((kl_k3(logprobs.detach(), rollout_lp) * tally).sum()))
                    _add(sums, "clip_fraction", float((policy.clipped * tally).sum()))
                    _add(sums, "trained_tokens", float(tally.sum()))
                    if row_index < real_rows:
                        _add(sums, "row_tokens", float(row.num_tokens))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, algo.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                grad_norm = grad_norm.full_tensor()
            grad_norms.append(float(grad_norm))
            optimizer.step()
            updates += 1
    if dp is not None:
        keys = ["loss", "entropy", "approx_kl", "clip_fraction", "trained_tokens", "row_tokens", "kl_ref"]
        reduced = dp.all_reduce([sums.get(k, 0.0) for k in keys] + [mismatch_sum, mismatch_kl, float(mismatch_n)])
        sums = dict(zip(keys, reduced[: len(keys)]))
        mismatch_sum, mismatch_kl, mismatch_n = reduced[-3], reduced[-2], int(reduced[-1])
        mismatch_max = dp.all_reduce([mismatch_max], op="max")[0]
    trained = max(sums.get("trained_tokens", 0.0), 1.0)
    out = {
        "loss": sums.get("loss", 0.0) / trained,
        "entropy": sums.get("entropy", 0.0) / trained,
        "approx_kl": sums.get("approx_kl", 0.0) / trained,
        "clip_fraction": sums.get("clip_fraction", 0.0) / trained,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "logprob_mismatch_max": mismatch_max,
        "logprob_mismatch_mean": mismatch_sum / max(mismatch_n, 1),
        "logprob_mismatch_kl": mismatch_kl / max(mismatch_n, 1),
        "optimizer_steps": float(updates),
        "merged_samples": float(merged),
        "train_tokens": sums.get("row_tokens", 0.0),
    }
    if reference is not None and algo.kl_coef:
        out["kl_ref"] = sums.get("kl_ref", 0.0) / trained
    return out


def _at_targets(logits: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """``logits`` at the row's trained targets (a row always has fewer targets than positions)."""
    if logits.shape[0] == row.positions.numel():
        return logits
    if logits.shape[0] != row.num_tokens:
        raise ValueError(
            f"forward returned logits for {logits.shape[0]} positions; the row has {row.num_tokens} "
            f"positions and {row.positions.numel()} targets"
        )
    return logits[row.positions.to(logits.device)]


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value
