"""Shift a tensor by one position along its last dimension, per document and across context parallelism.

Semantics are megatron-core's ``roll_tensor``: every document is shifted on its own and the
position a shift vacates at a document's end (left shift) or start (right shift) is filled with
zero, so nothing ever moves from one document into another. Under context parallelism (CP) the
sequence dimension is split the way megatron's load balancing splits it: each document is cut
into ``2 * cp_size`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r``.
A shift then needs one element from a neighbouring chunk, which may live on another rank; the
ranks exchange the first and last element of every local chunk (one small ``all_gather``).

:func:`roll` works on one rank's shard (real CP through a process group);
:func:`roll_shards` runs the same code on every rank's shard in one process (simulated CP),
which is how the contract is property-tested and verified without a cluster.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

LEFT = -1  # position i receives position i + 1: next-token labels
RIGHT = 1  # position i receives position i - 1


class ChunkSpan(NamedTuple):
    """One contiguous chunk of one document held by this rank."""

    document: int
    chunk: int  # global chunk index within the document
    lo: int  # local [lo, hi) along the last dimension
    hi: int
    global_lo: int  # global position of the chunk's first element


@dataclass(frozen=True)
class SequenceLayout:
    """How the last dimension of a (sharded) tensor maps onto documents and CP ranks.

    ``cu_seqlens``: global document boundaries along the sequence (cumulative lengths from 0, as
    in megatron's ``PackedSeqParams``; the CP-padded ones when ``cp_size > 1``). ``None`` means
    every row of the tensor is one document.
    """

    cu_seqlens: tuple[int, ...] | None = None
    cp_size: int = 1
    cp_rank: int = 0

    def __post_init__(self) -> None:
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {self.cp_rank}")
        if self.cu_seqlens is not None:
            cu = self.cu_seqlens
            if len(cu) < 2 or cu[0] != 0:
                raise ValueError(f"cu_seqlens must start at 0 and name at least one document, got {list(cu)}")
            for d, (start, stop) in enumerate(itertools.pairwise(cu)):
                if stop <= start:
                    raise ValueError(
                        f"cu_seqlens must be strictly increasing: document {d} spans [{start}, {stop})"
                    )
                if (stop - start) % self.chunks_per_document:
                    raise ValueError(
                        f"document {d} has {stop - start} tokens; with cp_size={self.cp_size} every "
                        f"document must be padded to a multiple of {self.chunks_per_document}"
                    )

    @property
    def chunks_per_document(self) -> int:
        return 1 if self.cp_size == 1 else 2 * self.cp_size

    def local_chunks(self) -> tuple[int, ...]:
        """Global chunk indices this rank holds, in local order."""
        if self.cp_size == 1:
            return (0,)
        return (self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank)

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, local slot) holding global chunk ``chunk`` of every document."""
        if self.cp_size == 1:
            return 0, 0
        return (chunk, 0) if chunk < self.cp_size else (2 * self.cp_size - 1 - chunk, 1)

    def documents(self, local_len: int) -> list[tuple[int, int]]:
        """Global [start, stop) of every document, given this rank's sequence length."""
        global_len = local_len * self.cp_size
        if self.cu_seqlens is None:
            if global_len % self.chunks_per_document:
                raise ValueError(
                    f"a row of {global_len} tokens cannot be split into {self.chunks_per_document} CP chunks"
                )
            return [(0, global_len)]
        if self.cu_seqlens[-1] != global_len:
            raise ValueError(
                f"cu_seqlens ends at {self.cu_seqlens[-1]} but the sequence holds {global_len} tokens "
                f"({local_len} on each of {self.cp_size} CP rank(s))"
            )
        return list(zip(self.cu_seqlens, self.cu_seqlens[1:]))

    def chunk_spans(self, local_len: int) -> list[ChunkSpan]:
        """Every chunk this rank holds, in local order."""
        spans = []
        for d, (start, stop) in enumerate(self.documents(local_len)):
            size = (stop - start) // self.chunks_per_document
            local = start // self.cp_size
            for slot, chunk in enumerate(self.local_chunks()):
                lo = local + slot * size
                spans.append(ChunkSpan(d, chunk, lo, lo + size, start + chunk * size))
        return spans

    def global_positions(self, local_len: int) -> list[int]:
        """The global sequence position of every local position."""
        out = [0] * local_len
        for span in self.chunk_spans(local_len):
            out[span.lo : span.hi] = range(span.global_lo, span.global_lo + span.hi - span.lo)
        return out


Exchange = Callable[["torch.Tensor"], "torch.Tensor"]


def chunk_ends(x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """First and last element of every local chunk: shape ``[..., documents, local chunks, 2]``."""
    import torch

    per_doc: dict[int, list[torch.Tensor]] = {}
    for span in layout.chunk_spans(x.shape[-1]):
        ends = torch.stack([x[..., span.lo], x[..., span.hi - 1]], dim=-1)
        per_doc.setdefault(span.document, []).append(ends)
    return torch.stack([torch.stack(chunks, dim=-2) for _, chunks in sorted(per_doc.items())], dim=-3)


def roll_with_ends(
    x: torch.Tensor, shift: int, layout: SequenceLayout, all_ends: torch.Tensor
) -> torch.Tensor:
    """Shift this rank's shard, taking neighbouring chunks' boundary elements from ``all_ends``
    (every rank's :func:`chunk_ends`, stacked along a new leading dimension)."""
    import torch

    if shift not in (LEFT, RIGHT):
        raise ValueError(f"shift must be {LEFT} or {RIGHT}, got {shift}")
    out = torch.zeros_like(x)
    last_chunk = layout.chunks_per_document - 1
    for d, chunk, lo, hi, _ in layout.chunk_spans(x.shape[-1]):
        if shift == LEFT:
            out[..., lo : hi - 1] = x[..., lo + 1 : hi]
            if chunk < last_chunk:
                rank, slot = layout.owner(chunk + 1)
                out[..., hi - 1] = all_ends[rank, ..., d, slot, 0]
        else:
            out[..., lo + 1 : hi] = x[..., lo : hi - 1]
            if chunk > 0:
                rank, slot = layout.owner(chunk - 1)
                out[..., lo] = all_ends[rank, ..., d, slot, 1]
    return out


def roll(
    x: torch.Tensor, shift: int = LEFT, layout: SequenceLayout | None = None, cp_group: Any = None
) -> torch.Tensor:
    """Shift ``x`` one position along its last dimension, per document, zero-filling at each end.

    With ``layout.cp_size > 1``, ``x`` is this rank's shard and ``cp_group`` the CP process group
    its peers call this function with.
    """
    layout = layout or SequenceLayout()
    ends = chunk_ends(x, layout)
    if layout.cp_size == 1:
        return roll_with_ends(x, shift, layout, ends.unsqueeze(0))
    if cp_group is None:
        raise ValueError(f"cp_size={layout.cp_size} needs the CP process group to exchange chunk boundaries")
    return roll_with_ends(x, shift, layout, _all_gather(ends, layout.cp_size, cp_group))


def roll_shards(
    shards: Sequence[torch.Tensor], shift: int, cu_seqlens: Sequence[int] | None
) -> list[torch.Tensor]:
    """Simulated CP: shift every rank's shard (``shards[r]`` is rank r's) in one process."""
    import torch

    cu = tuple(cu_seqlens) if cu_seqlens is not None else None
    layouts = [SequenceLayout(cu, len(shards), r) for r in range(len(shards))]
    all_ends = torch.stack([chunk_ends(s, lay) for s, lay in zip(shards, layouts)])
    return [roll_with_ends(s, shift, lay, all_ends) for s, lay in zip(shards, layouts)]


def shard(x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """This rank's shard of a global tensor (megatron's load-balanced CP split, per document)."""
    import torch

    index = layout.global_positions(x.shape[-1] // layout.cp_size)
    return x[..., torch.tensor(index, dtype=torch.long, device=x.device)]


def unshard(shards: Sequence[torch.Tensor], cu_seqlens: Sequence[int] | None) -> torch.Tensor:
    """Reassemble the global tensor from every rank's shard (inverse of :func:`shard`)."""
    import torch

    cp = len(shards)
    cu = tuple(cu_seqlens) if cu_seqlens is not None else None
    local_len = shards[0].shape[-1]
    out = shards[0].new_zeros(*shards[0].shape[:-1], local_len * cp)
    for rank, piece in enumerate(shards):
        index = SequenceLayout(cu, cp, rank).global_positions(local_len)
        out[..., torch.tensor(index, dtype=torch.long, device=piece.device)] = piece
    return out


def _all_gather(ends: torch.Tensor, cp_size: int, cp_group: Any) -> torch.Tensor:
    import torch
    import torch.distributed as dist

    payload = ends.to(torch.uint8) if ends.dtype == torch.bool else ends.contiguous()
    gathered = [torch.empty_like(payload) for _ in range(cp_size)]
    dist.all_gather(gathered, payload, group=cp_group)
    return torch.stack(gathered).to(ends.dtype)
