"""Preallocated per-slot model state of the lean runner: attention KV, causal-conv windows, recurrent states.

Every tensor's slot dimension is indexed by *row*. Rows ``[0, max_slots)`` hold decoding sequences,
kept compact (``[0, n)`` while ``n`` sequences decode) so that a decode step works on plain views;
``staging`` extra rows hold prompts whose prefill spans several chunks. All layers of one kind
live in one tensor, so moving rows (compaction, copying a prompt's state to its samples) is one
indexed copy per kind:

* ``keys``: ``[attention_layers, rows, kv_heads, capacity, head_dim]`` in the model dtype, or
  ``[attention_layers, rows, kv_heads, head_dim, capacity]`` with ``keys_transposed`` (the CPU's
  batched matmuls read ``K^T`` as stored); ``values``: ``[attention_layers, rows, kv_heads,
  capacity, head_dim]``. ``capacity`` grows by doubling up to ``max_model_len`` (which
  invalidates captured graphs: see :attr:`generation`);
* ``conv``: ``[gdn_layers, rows, kernel, channels]`` in the model dtype (channels last: the
  window's shift and the taps' sum run over contiguous rows);
* ``recurrent``: ``[gdn_layers, rows, v_heads, k_dim, v_dim]`` in ``recurrent_dtype`` (fp32 unless
  asked otherwise; the updates compute in fp32 whatever it stores);
* ``lengths``: tokens stored per row, on the device (positions of the next token) and mirrored on
  the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateShapes:
    attention_layers: int
    kv_heads: int
    head_dim: int
    gdn_layers: int
    conv_channels: int
    conv_kernel: int
    v_heads: int
    k_dim: int
    v_dim: int


class SlotState:
    def __init__(
        self,
        shapes: StateShapes,
        *,
        max_slots: int,
        staging: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_capacity: int = 256,
        keys_transposed: bool = False,
        recurrent_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.shapes = shapes
        self.max_slots = max_slots
        self.rows = max_slots + staging
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.device = device
        #: bumped whenever a tensor is reallocated (CUDA graphs captured before must be dropped)
        self.generation = 0
        self.capacity = min(initial_capacity, max_model_len)
        s = shapes
        self.keys_transposed = keys_transposed
        values = (s.attention_layers, self.rows, s.kv_heads, self.capacity, s.head_dim)
        keys = (*values[:3], s.head_dim, self.capacity) if keys_transposed else values
        self.keys = torch.zeros(keys, dtype=dtype, device=device)
        self.values = torch.zeros(values, dtype=dtype, device=device)
        self.conv = torch.zeros((s.gdn_layers, self.rows, s.conv_kernel, s.conv_channels), dtype=dtype, device=device)
        self.recurrent = torch.zeros((s.gdn_layers, self.rows, s.v_heads, s.k_dim, s.v_dim), dtype=recurrent_dtype, device=device)
        self.lengths = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.host_lengths = [0] * self.rows

    def ensure_capacity(self, needed: int) -> None:
        """Make room for ``needed`` positions per row (reallocating: bumps :attr:`generation`)."""
        if needed <= self.capacity:
            return
        if needed > self.max_model_len:
            raise RuntimeError(f"{needed} positions exceed max_model_len {self.max_model_len}")
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_model_len)
        self.values = _grow(self.values, 3, self.capacity, capacity)
        self.keys = _grow(self.keys, 4 if self.keys_transposed else 3, self.capacity, capacity)
        self.capacity = capacity
        self.generation += 1

    def reset_rows(self, rows: list[int]) -> None:
        """Start ``rows`` as fresh sequences: no tokens, zero conv windows. Their recurrent states
        are left as they are (18.9 MB a row in ``small-gpu``): a prefill from position 0 starts
        from zero states without reading them (:meth:`LeanModel.prefill`)."""
        if not rows:
            return
        index = torch.tensor(rows, device=self.device)
        self.conv.index_fill_(1, index, 0)
        self.lengths.index_fill_(0, index, 0)
        for row in rows:
            self.host_lengths[row] = 0

    def copy_rows(self, sources: list[int], targets: list[int]) -> None:
        """Row ``targets[i]`` becomes a copy of row ``sources[i]``, all at once (the sources are read
        before any target is written, so permutations and repeated sources are fine)."""
        if not sources:
            return
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        # index_select + index_copy_ move whole contiguous rows (an indexed assignment would
        # compute an offset per element: ~20x slower on CPU)
        for t in (self.keys, self.values, self.conv, self.recurrent):
            t.index_copy_(1, dst, t.index_select(1, src))
        self.lengths.index_copy_(0, dst, self.lengths.index_select(0, src))
        lengths = [self.host_lengths[r] for r in sources]
        for row, n in zip(targets, lengths):
            self.host_lengths[row] = n

    def clear_lengths(self, rows: range) -> None:
        """Free rows keep their tensors but count no tokens (positions stay inside the KV capacity
        when a CUDA graph computes padding rows)."""
        if len(rows):
            self.lengths[rows.start : rows.stop] = 0
            for row in rows:
                self.host_lengths[row] = 0


def _grow(t: torch.Tensor, dim: int, old: int, new: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = new
    grown = t.new_zeros(shape)
    grown.narrow(dim, 0, old).copy_(t)
    return grown
