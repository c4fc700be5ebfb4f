"""Training documents and the packed rows the trainer runs.

A row lists its trained targets explicitly: target ``k`` is predicted by the logits at position
``positions[k]`` (for a document laid out whole, the position just before the target), so the
trainer computes logits, log-probs and losses at trained targets only; a target in the next
document is never trained (the row's position ids restart at 0 for each document, which is how the
model patches find the boundaries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class TrainDocument:
    """One trajectory to train on: the full token sequence and what is trained in it.

    ``loss_mask``, ``rollout_logprobs`` are per *response* token (``len == response_length``);
    the response is the last ``response_length`` tokens of ``token_ids`` (multi-turn responses
    carry observation tokens with mask 0 inside). ``multiplicity`` is how many identical samples
    the document stands for: the update weighs its tokens that many times (:func:`merge_duplicates`).
    """

    token_ids: tuple[int, ...]
    response_length: int
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    advantage: float
    multiplicity: int = 1

    def __post_init__(self) -> None:
        if self.multiplicity < 1:
            raise ValueError(f"multiplicity {self.multiplicity} must be at least 1")
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
    """Documents laid out in one row of ``T`` tokens, and their ``K`` trained targets.

    ``input_ids``/``position_ids`` are ``[T]``; every other tensor is ``[K]``, one entry per
    trained target: ``targets[k]`` is predicted by the logits at position ``positions[k]``. Without
    shared prompts, target ``k`` is the token after ``positions[k]`` in the same document; with
    them (:func:`pack_documents` ``share_prompts=True``) a group's documents follow one copy of their
    common prompt, so the prompt's last position predicts every document's first response token,
    and ``branches`` says which tokens each document's response attends to.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    positions: torch.Tensor  # long: the position whose logits predict each target
    targets: torch.Tensor  # long
    loss_mask: torch.Tensor  # float 0/1 (0 only in a data-parallel filler row)
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    doc_index: torch.Tensor  # which of the row's documents (0 .. num_docs - 1) owns each target
    num_docs: int
    #: float: how many identical samples each target's document stands for; ``None``: one each
    multiplicity: torch.Tensor | None = None
    #: for a row with shared prompts, every response after a group's first: ``(start, root, prefix)``
    #: -- the response at ``start`` attends to the ``prefix`` tokens at ``root`` (its prompt), then
    #: causally to itself; ``None`` when every document is laid out whole
    branches: tuple[tuple[int, int, int], ...] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def token_mask(self) -> torch.Tensor:
        """``[T]``: 1 at each position whose logits are trained (for per-position consumers, such as
        megatron's multi-token-prediction labels; defined for rows without shared prompts)."""
        if self.branches is not None:
            raise ValueError("a row with shared prompts has no per-position loss mask")
        return torch.zeros(self.num_tokens).index_put_((self.positions,), self.loss_mask)


def merge_duplicates(docs: Sequence[TrainDocument]) -> list[TrainDocument]:
    """``docs`` with exact duplicates merged into their first occurrence, multiplicities summed.

    Two samples with the same tokens, loss mask, rollout log-probs and advantage contribute the
    same per-token losses and gradients (a document's loss depends on its own tokens only: rows
    are an arbitrary packing), so training one of them with twice the weight is the same update
    at half the compute. Groups of short answers are full of such repeats once the policy
    sharpens; long free-form samples almost never repeat, and then this returns ``docs`` as is.
    """
    # candidates by a key read in O(1) (hashing whole token tuples costs ~18 us per 1k-token
    # sample); the full comparison runs only on a candidate and stops at the first difference
    candidates: dict[tuple[object, ...], list[int]] = {}
    merged: list[TrainDocument] = []
    counts: list[int] = []
    for doc in docs:
        key = (doc.advantage, doc.response_length, len(doc.token_ids), doc.token_ids[-1], doc.rollout_logprobs[-1])
        bucket = candidates.setdefault(key, [])
        for at in bucket:
            if _same_sample(merged[at], doc):
                counts[at] += doc.multiplicity
                break
        else:
            bucket.append(len(merged))
            merged.append(doc)
            counts.append(doc.multiplicity)
    if len(merged) == len(docs):
        return list(docs)
    return [d if c == d.multiplicity else replace(d, multiplicity=c) for d, c in zip(merged, counts, strict=True)]


def _same_sample(a: TrainDocument, b: TrainDocument) -> bool:
    return a.token_ids == b.token_ids and a.rollout_logprobs == b.rollout_logprobs and a.loss_mask == b.loss_mask


@dataclass(frozen=True)
class _Unit:
    """Documents laid out together: one prompt copy, then each document's response."""

    prompt: tuple[int, ...]
    members: tuple[int, ...]  # indices into the documents
    length: int


def _units(docs: Sequence[TrainDocument], max_tokens_per_row: int, share_prompts: bool) -> list[_Unit]:
    if not share_prompts:
        return [_Unit(d.token_ids[: len(d.token_ids) - d.response_length], (i,), len(d.token_ids))
                for i, d in enumerate(docs)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, doc in enumerate(docs):
        groups.setdefault(doc.token_ids[: len(doc.token_ids) - doc.response_length], []).append(i)
    units = []
    for prompt, members in groups.items():  # a group longer than a row is split, each part with its prompt
        part: list[int] = []
        length = len(prompt)
        for i in members:
            n = docs[i].response_length
            if part and length + n > max_tokens_per_row:
                units.append(_Unit(prompt, tuple(part), length))
                part, length = [], len(prompt)
            part.append(i)
            length += n
        units.append(_Unit(prompt, tuple(part), length))
    return units


def pack_documents(
    docs: Sequence[TrainDocument], max_tokens_per_row: int, *, packing: bool = True, share_prompts: bool = False
) -> list[PackedRow]:
    """First-fit packing in document order; ``packing=False`` gives one document per row.

    A document longer than ``max_tokens_per_row`` gets a row of its own (never truncated: a
    truncated document would train on log-probs it was not sampled with). ``share_prompts``
    (with ``packing``) lays out documents with identical prompts -- a GRPO group -- as one copy of
    the prompt followed by every response (see :class:`PackedRow`), a row's groups ordered by shape
    (prompt length, responses, tokens); only a model whose attention honours ``branches`` may run
    such rows.
    """
    units = _units(docs, max_tokens_per_row, share_prompts and packing)
    bins: list[list[_Unit]] = []
    loads: list[int] = []
    for unit in units:
        for b, load in enumerate(loads):
            if packing and load + unit.length <= max_tokens_per_row:
                bins[b].append(unit)
                loads[b] += unit.length
                break
        else:
            bins.append([unit])
            loads.append(unit.length)
    if share_prompts and packing:
        # within a row, groups of one shape side by side: the attention runs such a run of groups
        # as one batched call on a view of the row, where scattered groups are gathered and put back
        bins = [sorted(members, key=_shape) for members in bins]
    return [_row(docs, members) for members in bins]


def _shape(unit: _Unit) -> tuple[int, int, int]:
    return len(unit.prompt), len(unit.members), unit.length


def _row(docs: Sequence[TrainDocument], units: list[_Unit]) -> PackedRow:
    ids: list[int] = []
    pos: list[int] = []
    at: list[int] = []
    tgt: list[int] = []
    mask: list[float] = []
    logps: list[float] = []
    adv: list[float] = []
    copies: list[float] = []
    owner: list[int] = []
    branches: list[tuple[int, int, int]] = []
    local = 0
    for unit in units:
        root, p = len(ids), len(unit.prompt)
        ids += unit.prompt
        pos += range(p)
        for nth, i in enumerate(unit.members):
            doc = docs[i]
            response = doc.token_ids[p:]
            start = len(ids)
            if nth:
                branches.append((start, root, p))
            ids += response
            pos += range(p, p + len(response))
            for j, (token, m) in enumerate(zip(response, doc.loss_mask, strict=True)):
                if not m:
                    continue
                at.append(root + p - 1 if j == 0 else start + j - 1)
                tgt.append(token)
                mask.append(1.0)
                logps.append(doc.rollout_logprobs[j])
                adv.append(doc.advantage)
                copies.append(doc.multiplicity)
                owner.append(local)
            local += 1
    return PackedRow(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        positions=torch.tensor(at, dtype=torch.long),
        targets=torch.tensor(tgt, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        rollout_logprobs=torch.tensor(logps, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        doc_index=torch.tensor(owner, dtype=torch.long),
        num_docs=local,
        branches=tuple(branches) if branches else None,
        multiplicity=torch.tensor(copies, dtype=torch.float32) if any(c != 1 for c in copies) else None,
    )
