"""Build canonical batches from samples, and re-lay them out for the attention a model has.

A sample is ``(token_ids, trained)`` where ``trained[j]`` says whether token ``j`` is a trained
(response) token. The token-aligned loss mask of the contract is derived here, once:
``loss_mask[i] = trained[i + 1]`` within the document.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles_mtp.contract import LabelContractError, MTPBatch
from miles_mtp.roll import SequenceLayout

Sample = tuple[Sequence[int], Sequence[int]]


def _token_aligned(trained: Sequence[int]) -> list[int]:
    return [int(bool(t)) for t in trained[1:]] + [0]


def pack(samples: Sequence[Sample], pad_to_multiple: int = 1, pad_id: int = 0) -> MTPBatch:
    """One packed row ``[1, total]`` with ``cu_seqlens``; each document is right-padded (untrained
    ``pad_id`` tokens) to a multiple of ``pad_to_multiple`` (``2 * cp_size`` under CP)."""
    import torch

    if not samples:
        raise LabelContractError("pack needs at least one sample")
    tokens: list[int] = []
    mask: list[int] = []
    cu = [0]
    for index, (ids, trained) in enumerate(samples):
        if len(ids) != len(trained) or not ids:
            raise LabelContractError(
                f"sample {index}: {len(ids)} token ids and {len(trained)} trained flags (need equal, non-zero)"
            )
        pad = -len(ids) % pad_to_multiple
        tokens += [int(t) for t in ids] + [pad_id] * pad
        mask += _token_aligned(list(trained) + [0] * pad)
        cu.append(len(tokens))
    return MTPBatch(torch.tensor([tokens]), torch.tensor([mask]), SequenceLayout(tuple(cu)))


def rows(samples: Sequence[Sample], pad_id: int = 0) -> MTPBatch:
    """One right-padded row per sample ``[len(samples), longest]``: every row is one document, so
    attention without packed-sequence support (megatron's local spec, CPU) stays per document."""
    import torch

    if not samples:
        raise LabelContractError("rows needs at least one sample")
    longest = max(len(ids) for ids, _ in samples)
    tokens = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for index, (ids, trained) in enumerate(samples):
        if len(ids) != len(trained) or not ids:
            raise LabelContractError(
                f"sample {index}: {len(ids)} token ids and {len(trained)} trained flags (need equal, non-zero)"
            )
        tokens[index, : len(ids)] = torch.tensor([int(t) for t in ids])
        mask[index, : len(ids)] = torch.tensor(_token_aligned(trained))
    return MTPBatch(tokens, mask, SequenceLayout())


def samples_of(batch: MTPBatch) -> list[Sample]:
    """The samples of a packed (CP size 1) or row batch; pads of row batches are kept."""
    if batch.layout.cp_size != 1:
        raise LabelContractError("samples_of needs the whole sequence (cp_size 1), not a CP shard")
    out: list[Sample] = []
    for row in range(batch.tokens.shape[0]):
        ids = batch.tokens[row].tolist()
        mask = batch.loss_mask[row].tolist()
        for start, stop in batch.layout.documents(len(ids)):
            trained = [0] + [int(m) for m in mask[start : stop - 1]]
            out.append((ids[start:stop], trained))
    return out
