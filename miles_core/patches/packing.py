"""The per-forward packing context: which documents share the rows of a batch.

A trainer packs documents into a row and marks each one by ``position_ids`` that restart at 0
(``[0, 1, 2, 0, 1, 0, 1, 2, 3]``). :func:`packed_sequences` turns that into a
:class:`PackedSequences` (``cu_seqlens``, ``seq_idx``, ``max_seqlen``) or ``None`` when the batch is
not packed. Segments follow transformers' own rule for packed attention masks (a new segment
wherever a position is not its predecessor + 1, and at every row start), so sequence-mixing layers
and attention layers always agree on the boundaries. Padding is whatever its positions say: pad
positions ``0, 1, 2, ...`` form one segment, pad positions that are all 0 are 1-token segments;
either way a pad never mixes with a document.

The context is owned by the framework, not by modules: the model-level scope that
:func:`miles_core.patches.prepare_model` installs derives it once per forward, publishes it through
a :mod:`contextvars` variable for exactly that forward (and resets it afterwards, to ``None`` for an
unpacked batch, whether the forward returned or raised), and hands the same object down the
forward's keyword arguments under :data:`PACKING_KWARG`. Activation checkpointing replays a layer
with the keyword arguments it captured, so a recomputed layer sees the identical object.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from miles_core.errors import ConfigError

#: keyword argument under which the model-level scope passes the context down a forward
PACKING_KWARG = "miles_packed_sequences"

_CURRENT: contextvars.ContextVar[PackedSequences | None] = contextvars.ContextVar(
    "miles_packed_sequences", default=None
)
#: (model id, owner id, token) of every model-level scope open in this context, innermost last:
#: ``owner`` is the module whose forward opened it, ``model`` the prepared model it belongs to
_MODEL_SCOPES: contextvars.ContextVar[tuple[tuple[int, int, contextvars.Token], ...]] = contextvars.ContextVar(
    "miles_model_packing_scopes", default=()
)


class PackingError(ConfigError):
    """A forward's inputs describe packed documents in a way the model would mix them."""


@dataclass(frozen=True, eq=False)
class PackedSequences:
    """Document boundaries of one packed forward; rows are flattened back to back.

    ``cu_seqlens`` (int32, ``[N + 1]``, on the batch's device) are offsets into the flattened
    ``batch_size * seq_len`` tokens; every row start is a boundary. ``cu_seqlens_cpu`` is the same
    on the CPU, so kernels can plan launches without a device sync. ``seq_idx`` (int32,
    ``[batch_size, seq_len]``) is each token's segment index.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    seq_idx: torch.Tensor
    max_seqlen: int
    batch_size: int
    seq_len: int
    #: segments that continue a shared prompt instead of standing alone, as flattened-token offsets
    #: ``(start, root, prefix)``: the segment at ``start`` attends to the ``prefix`` tokens at
    #: ``root`` (a segment starting at position 0), then causally to itself. Only attention honours
    #: this (:mod:`miles_core.patches.attention`); a layer with state across tokens (a recurrent or
    #: convolutional sequence mixer) must refuse such a context. ``None``: every segment stands alone.
    branches: tuple[tuple[int, int, int], ...] | None = None

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens_cpu.numel() - 1

    def lengths(self) -> list[int]:
        return torch.diff(self.cu_seqlens_cpu).tolist()

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int], device: torch.device | str | None = None
    ) -> PackedSequences:
        """The context of one row holding documents of ``lengths`` back to back."""
        if not lengths or any(int(n) <= 0 for n in lengths):
            raise ValueError(f"lengths must be positive, got {list(lengths)}")
        cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        seq_idx = torch.repeat_interleave(
            torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths)
        )
        return cls(
            cu_seqlens=cu_cpu.to(device),
            cu_seqlens_cpu=cu_cpu,
            seq_idx=seq_idx.view(1, -1).to(device),
            max_seqlen=max(int(n) for n in lengths),
            batch_size=1,
            seq_len=int(cu_cpu[-1]),
        )


def packed_position_ids(
    lengths: Sequence[int], *, pad: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[1, sum(lengths) + pad]`` position ids for documents packed back to back.

    Each document counts from 0; ``pad`` trailing pad tokens count from 0 too, so the padding is
    one segment of its own.
    """
    runs = [*lengths, pad] if pad else list(lengths)
    return torch.cat([torch.arange(int(n), device=device) for n in runs]).view(1, -1)


def _text_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``[B, T]`` text positions and whether transformers' attention can see their boundaries.

    1-D ids are one row. 3-D ids with 4 rows carry text positions in row 0 (the multimodal
    Qwen convention); other 3-D ids (m-RoPE only) hide boundaries from the attention mask.
    """
    if position_ids.ndim == 1:
        return position_ids.view(1, -1), True
    if position_ids.ndim == 2:
        return position_ids, True
    if position_ids.ndim == 3:
        return position_ids[0], position_ids.shape[0] == 4
    raise PackingError(f"position_ids must be 1-D, 2-D or 3-D, got shape {tuple(position_ids.shape)}")


def packed_sequences(
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None = None,
    *,
    branches: Sequence[tuple[int, int, int]] | None = None,
) -> PackedSequences | None:
    """The packing context of a forward, or ``None`` when no row holds more than one document.

    A row is packed when a token at position 0 follows another token of the same row (with an
    ``attention_mask``, only real tokens count, so left padding is not mistaken for packing).
    Packed rows must come without an ``attention_mask``: transformers ignores position-based
    packing when a mask is given, so attention would mix the documents. That and m-RoPE-only
    position ids raise :class:`PackingError`.

    ``branches`` (see :attr:`PackedSequences.branches`) describe a trainer's shared-prompt row; each
    is checked against the positions: a branch starts a segment at position ``prefix``, and its
    root is a segment whose first ``prefix`` positions count from 0.
    """
    if position_ids is None:
        return None
    if branches:
        return _with_branches(position_ids, attention_mask, tuple(branches))
    pos, boundaries_visible = _text_positions(position_ids)
    if pos.shape[1] < 2:
        return None
    restarts = pos[:, 1:] == 0
    if attention_mask is not None and attention_mask.ndim == 2:
        if attention_mask.shape != pos.shape:
            raise PackingError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but position_ids describe "
                f"{tuple(pos.shape)}"
            )
        real = attention_mask.bool()
        restarts = restarts & real[:, 1:] & (real.cumsum(-1)[:, :-1] > 0)
    if not bool(restarts.any()):
        return None
    return _segments(pos, position_ids, attention_mask, boundaries_visible)


def _segments(pos: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              boundaries_visible: bool, branches: tuple[tuple[int, int, int], ...] | None = None) -> PackedSequences:
    batch_size, seq_len = pos.shape
    if attention_mask is not None:
        raise PackingError(
            "position_ids restart at 0 inside a row (packed documents) but an attention_mask was "
            "passed: transformers ignores position-based packing when a mask is given, so attention "
            "would mix the documents. Pass attention_mask=None for packed rows; give padding its own "
            "positions (see docs/patches.md)."
        )
    if not boundaries_visible:
        raise PackingError(
            f"position_ids of shape {tuple(position_ids.shape)} (m-RoPE rows without a text row) "
            "restart at 0 inside a row, but transformers cannot see document boundaries in them. "
            "Pass 2-D text position_ids for packed rows."
        )
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    flat = starts.reshape(-1)
    offsets = flat.nonzero().squeeze(1)
    cu_seqlens = torch.cat([offsets, offsets.new_tensor([flat.numel()])]).to(torch.int32)
    cu_seqlens_cpu = cu_seqlens.cpu()
    return PackedSequences(
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        seq_idx=(flat.cumsum(0) - 1).to(torch.int32).view(batch_size, seq_len),
        max_seqlen=int(torch.diff(cu_seqlens_cpu).max()),
        batch_size=batch_size,
        seq_len=seq_len,
        branches=branches,
    )


def _with_branches(position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   branches: tuple[tuple[int, int, int], ...]) -> PackedSequences:
    pos, visible = _text_positions(position_ids)
    ctx = _segments(pos, position_ids, attention_mask, visible, branches)
    flat = pos.reshape(-1).tolist()
    starts = set(ctx.cu_seqlens_cpu.tolist())
    for start, root, prefix in branches:
        if start not in starts or root not in starts or not 0 < prefix <= start - root:
            raise PackingError(f"branch {(start, root, prefix)} does not start a segment after its root's prefix")
        if flat[start] != prefix or flat[root : root + prefix] != list(range(prefix)):
            raise PackingError(
                f"branch {(start, root, prefix)}: its positions must continue the root's first {prefix} "
                f"positions 0..{prefix - 1}"
            )
    return ctx


def current_packed_sequences() -> PackedSequences | None:
    """The context of the forward running in this thread (``None`` outside one or when unpacked)."""
    return _CURRENT.get()


@contextlib.contextmanager
def packing_scope(ctx: PackedSequences | None) -> Iterator[PackedSequences | None]:
    """Make ``ctx`` current for the block; the previous value is restored however it exits."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def enter_model_scope(owner: object, ctx: PackedSequences | None, *, model: object | None = None) -> None:
    """Open ``owner``'s scope (a forward of ``model``, by default ``owner`` itself): ``ctx`` is
    current until :func:`exit_model_scope`."""
    model_id = id(owner if model is None else model)
    _MODEL_SCOPES.set((*_MODEL_SCOPES.get(), (model_id, id(owner), _CURRENT.set(ctx))))


def exit_model_scope(owner: object) -> None:
    """Close ``owner``'s scope if it is the innermost one (a forward whose entry failed opened none)."""
    scopes = _MODEL_SCOPES.get()
    if scopes and scopes[-1][1] == id(owner):
        _MODEL_SCOPES.set(scopes[:-1])
        _CURRENT.reset(scopes[-1][2])


def model_scope_open(model: object | None = None) -> bool:
    """Whether a model-level scope is open in this context (a forward, not a checkpoint replay);
    with ``model``, whether the innermost one is a forward of that model."""
    scopes = _MODEL_SCOPES.get()
    if model is None:
        return bool(scopes)
    return bool(scopes) and scopes[-1][0] == id(model)
