"""The canonical multi-token-prediction label contract, and the invariant every path must meet.

At the trainer boundary the model receives **raw token ids** and a **token-aligned loss mask**:
``loss_mask[i] = 1`` trains the prediction of ``tokens[i + 1]`` (so a document's last position is
never trained). Nothing upstream of the model's adapter shifts anything.

The invariant, for MTP depth ``k >= 1`` (depth 0 is the main next-token head) and every position
``i`` of a document ``[start, stop)``:

* if ``i + k + 1 < stop``: the target is ``tokens[i + k + 1]`` and the position is trained iff
  ``loss_mask[i + k]`` is (iff ``tokens[i + k + 1]`` is a trained response token);
* otherwise the target would cross the document end and the position is not trained.

:func:`expected_depth` states this with plain index arithmetic on the global sequence (no roll),
so the rolls and adapters are tested against an independent reference.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles_core.errors import MilesError
from miles_mtp.roll import SequenceLayout

if TYPE_CHECKING:
    import torch


class LabelContractError(MilesError):
    """A batch or a model path that breaks the MTP label contract."""


@dataclass(frozen=True)
class MTPBatch:
    """What the trainer hands the model: raw ``tokens`` and a token-aligned ``loss_mask``.

    Both are ``[batch, sequence]``; with ``layout.cp_size > 1`` they are this rank's CP shard.
    Packed rows (``layout.cu_seqlens`` set) have batch size 1.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    layout: SequenceLayout = field(default_factory=SequenceLayout)

    def __post_init__(self) -> None:
        tokens, mask = self.tokens, self.loss_mask
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise LabelContractError(
                f"tokens must be an integer tensor [batch, sequence], got {tuple(tokens.shape)} {tokens.dtype}"
            )
        if mask.shape != tokens.shape:
            raise LabelContractError(
                f"loss_mask has shape {tuple(mask.shape)}, tokens {tuple(tokens.shape)}: they must match"
            )
        if self.layout.cu_seqlens is not None and tokens.shape[0] != 1:
            raise LabelContractError(f"packed rows (cu_seqlens set) have batch size 1, got {tokens.shape[0]}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise LabelContractError("loss_mask must hold only 0 and 1")
        try:
            last = document_last_positions(self.layout, tokens.shape[-1])
        except ValueError as exc:
            raise LabelContractError(f"layout does not fit the batch: {exc}") from exc
        trained_last = mask[:, last].nonzero()
        if len(trained_last):
            row, col = (int(v) for v in trained_last[0])
            pos = last[col]
            raise LabelContractError(
                f"loss_mask[{row}, {pos}] = 1 trains past the end of its document (position {pos} is a "
                "document's last token). The mask is token-aligned: loss_mask[i] = 1 trains the "
                "prediction of tokens[i + 1], so it is 0 on every document's last position"
            )

    def float_mask(self) -> torch.Tensor:
        import torch

        return self.loss_mask.to(torch.float32)


def document_last_positions(layout: SequenceLayout, local_len: int) -> list[int]:
    """Local positions holding a document's last token (on this rank: the end of the document's
    last chunk, which the rank may or may not hold)."""
    last_chunk = layout.chunks_per_document - 1
    return [span.hi - 1 for span in layout.chunk_spans(local_len) if span.chunk == last_chunk]


def expected_depth(
    tokens: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: tuple[int, ...] | None, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for depth ``depth`` on global ``[batch, sequence]`` tensors.

    Returns ``(targets, inside, trained)``: ``targets[i] = tokens[i + depth + 1]`` where ``inside``
    (the target stays in the document), and ``trained`` the mask the depth's loss must apply.
    """
    import torch

    length = tokens.shape[-1]
    cu = cu_seqlens or (0, length)
    stop = torch.empty(length, dtype=torch.long)
    for start, end in itertools.pairwise(cu):
        stop[start:end] = end
    pos = torch.arange(length)
    source = pos + depth + 1
    inside = source < stop
    clamped = source.clamp(max=length - 1)
    targets = torch.where(inside, tokens[..., clamped], torch.zeros_like(tokens))
    mask_source = (pos + depth).clamp(max=length - 1)
    trained = inside & (loss_mask[..., mask_source] != 0)
    return targets, inside.expand_as(tokens), trained


@dataclass(frozen=True)
class Observation:
    """What one depth's loss received: its ``labels`` and the per-position ``weight`` it applied
    (proportional to the loss mask: the gradient of the objective w.r.t. the per-token loss)."""

    labels: torch.Tensor
    weight: torch.Tensor


def contract_violations(
    observed: Mapping[int, Observation],
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: tuple[int, ...] | None,
    depths: int,
) -> list[str]:
    """Every way ``observed`` (global tensors, keyed by depth) breaks the invariant; empty if none.

    Depth 0 (the main head) is checked when observed; every MTP depth ``1..depths`` must be.
    """
    problems: list[str] = []
    missing = [k for k in range(1, depths + 1) if k not in observed]
    if missing:
        problems.append(f"MTP depth(s) {missing} computed no loss")
    for k in sorted(observed):
        obs = observed[k]
        targets, inside, trained = expected_depth(tokens, loss_mask, cu_seqlens, k)
        name = "main head" if k == 0 else f"MTP depth {k}"
        wrong = inside & (obs.labels != targets)
        if bool(wrong.any()):
            row, pos = (int(v) for v in wrong.nonzero()[0])
            got = int(obs.labels[row, pos])
            problems.append(
                f"{name}: position {pos} has target {got}, expected tokens[{pos + k + 1}] = "
                f"{int(targets[row, pos])}{_describe_offset(obs.labels, tokens, cu_seqlens, k, inside)}"
            )
        applied = _normalised(obs.weight)
        if applied is None:
            if bool(trained.any()) and k > 0:
                problems.append(f"{name}: no position is trained, expected {int(trained.sum())}")
            continue
        if k == 0:
            continue  # the main head's mask is applied by the trainer's own loss, not by the model
        off = (applied - trained.to(applied.dtype)).abs() > 1e-4
        if bool(off.any()):
            row, pos = (int(v) for v in off.nonzero()[0])
            problems.append(
                f"{name}: position {pos} is {'trained' if applied[row, pos] > 0.5 else 'not trained'}, "
                f"expected {'trained' if trained[row, pos] else 'not trained'} "
                f"(loss_mask[{pos + k}] = {int(loss_mask[row, min(pos + k, loss_mask.shape[-1] - 1)])})"
                f"{_describe_mask_offset(applied, loss_mask, cu_seqlens, k)}"
            )
    return problems


def _normalised(weight: torch.Tensor) -> torch.Tensor | None:
    """Scale a weight proportional to a 0/1 mask back to 0/1 (None when nothing is weighted)."""
    peak = weight.abs().max()
    if not bool(peak > 0):
        return None
    return weight / peak


def _describe_offset(
    labels: torch.Tensor, tokens: torch.Tensor, cu_seqlens: tuple[int, ...] | None, depth: int, inside: torch.Tensor
) -> str:
    for offset in range(depth + 5):
        if offset == depth + 1:
            continue
        ref, ref_inside, _ = expected_depth(tokens, tokens, cu_seqlens, offset - 1)
        both = inside & ref_inside
        if bool(both.any()) and bool((labels[both] == ref[both]).all()):
            return f" (it trains toward tokens[i + {offset}] instead of tokens[i + {depth + 1}])"
    return ""


def _describe_mask_offset(
    applied: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: tuple[int, ...] | None, depth: int
) -> str:
    for lead in (1, -1, 2):
        _, _, trained = expected_depth(loss_mask, loss_mask, cu_seqlens, depth + lead)
        if bool((applied.round() == trained.to(applied.dtype)).all()):
            where = "ahead of" if lead > 0 else "behind"
            return f" (the mask is {abs(lead)} position(s) {where} its labels)"
    return ""
