"""Training documents and the packed rows the trainer runs.

Everything is token-aligned the way a causal LM predicts: in a packed row, position ``t`` carries
the log-prob of token ``t + 1``; ``loss_mask[t]`` says whether that target is a trained response
token; a target in the next document is never trained (the row's position ids restart at 0 for
each document, which is how the model patches find the boundaries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TrainDocument:
    """One trajectory to train on: the full token sequence and what is trained in it.

    ``loss_mask``, ``rollout_logprobs`` are per *response* token (``len == response_length``);
    the response is the last ``response_length`` tokens of ``token_ids`` (multi-turn responses
    carry observation tokens with mask 0 inside).
    """

    token_ids: tuple[int, ...]
    response_length: int
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    advantage: float

    def __post_init__(self) -> None:
        n = self.response_length
        if not 0 < n < len(self.token_ids):
            raise ValueError(f"response_length {n} must be in [1, {len(self.token_ids) - 1}] (a prompt is needed)")
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"loss_mask ({len(self.loss_mask)}) and rollout_logprobs ({len(self.rollout_logprobs)}) "
                f"must have response_length ({n}) entries"
            )


@dataclass
class PackedRow:
    """Documents concatenated into one row; every tensor is ``[T]``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor  # token t+1 within the same document, else -100
    loss_mask: torch.Tensor  # float 0/1
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    doc_index: torch.Tensor  # which of the row's documents (0 .. num_docs - 1) owns each position
    num_docs: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def _aligned(doc: TrainDocument) -> tuple[list[int], list[float], list[float], list[float]]:
    """Targets, mask, rollout log-probs and advantages at positions 0..len-1 of ``doc``."""
    ids = list(doc.token_ids)
    n, prompt = len(ids), len(ids) - doc.response_length
    targets = [*ids[1:], -100]
    mask = [0.0] * (prompt - 1) + [float(m) for m in doc.loss_mask] + [0.0]
    logps = [0.0] * (prompt - 1) + list(doc.rollout_logprobs) + [0.0]
    adv = [doc.advantage] * n
    return targets, mask, logps, adv


def pack_documents(docs: Sequence[TrainDocument], max_tokens_per_row: int, *, packing: bool = True) -> list[PackedRow]:
    """First-fit packing in document order; ``packing=False`` gives one document per row.

    A document longer than ``max_tokens_per_row`` gets a row of its own (never truncated: a
    truncated document would train on log-probs it was not sampled with).
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for i, doc in enumerate(docs):
        n = len(doc.token_ids)
        for b, load in enumerate(loads):
            if packing and load + n <= max_tokens_per_row:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    rows = []
    for members in bins:
        ids: list[int] = []
        pos: list[int] = []
        tgt: list[int] = []
        mask: list[float] = []
        logps: list[float] = []
        adv: list[float] = []
        owner: list[int] = []
        for local, i in enumerate(members):
            doc = docs[i]
            t, m, lp, a = _aligned(doc)
            ids += doc.token_ids
            pos += range(len(doc.token_ids))
            tgt += t
            mask += m
            logps += lp
            adv += a
            owner += [local] * len(doc.token_ids)
        rows.append(
            PackedRow(
                input_ids=torch.tensor(ids, dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long),
                targets=torch.tensor(tgt, dtype=torch.long),
                loss_mask=torch.tensor(mask, dtype=torch.float32),
                rollout_logprobs=torch.tensor(logps, dtype=torch.float32),
                advantages=torch.tensor(adv, dtype=torch.float32),
                doc_index=torch.tensor(owner, dtype=torch.long),
                num_docs=len(members),
            )
        )
    return rows
