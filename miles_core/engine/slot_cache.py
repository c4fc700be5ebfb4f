"""The Hugging Face path's per-sequence state: attention KV plus linear-attention states.

The engine runs a model without a lean forward (:mod:`miles_core.engine.lean_model`) through its
own Hugging Face modules, handing them this module's :class:`StepCache`. :class:`SlotStore` keeps
the state of up to ``max_slots`` sequences in preallocated tensors whose first dimension is the
row; decoding sequences occupy rows ``[0, n)`` (the engine keeps them compact), so a decode step
works on plain views.

* attention layers: ``K``/``V`` of shape ``[slots, kv_heads, capacity, head_dim]``; row ``r``
  holds its first ``lengths[r]`` positions. Capacity grows by doubling.
* linear-attention (Gated DeltaNet) layers: the causal-conv window ``[slots, channels, kernel]``
  and the recurrent state ``[slots, heads, k_dim, v_dim]``.

:class:`StepCache` is the ``transformers`` cache object handed to one forward pass. It speaks
the interface the Hugging Face modeling code calls (``update`` for attention,
``get/update_conv_state`` and ``get/update_recurrent_state`` for linear attention, plus the
bookkeeping calls of later releases: ``increase_count``, ``get_recurrent_states_to_keep``) and
maps it onto the rows of the store. A forward is either a *prefill* of one row (its whole prompt) or
a *decode* of rows ``[0, n)`` (one token each). Masks and positions are built here too, so the
model never derives them from the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
SUPPORTED_LAYER_TYPES = frozenset({LINEAR_ATTENTION, FULL_ATTENTION})


class SlotStore:
    """The state tensors of up to ``max_slots`` sequences, one row per sequence."""

    def __init__(self, max_slots: int, *, initial_capacity: int = 256) -> None:
        self.max_slots = max_slots
        self.capacity = initial_capacity
        self.lengths: list[int] = [0] * max_slots  # tokens stored per row
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}

    # -- row management ---------------------------------------------------------------------

    def copy_rows(self, sources: list[int], targets: list[int]) -> None:
        """Row ``targets[i]`` becomes a copy of row ``sources[i]`` (all sources read first)."""
        if not sources:
            return
        n = max(self.lengths[r] for r in sources)
        for store in (self.keys, self.values):
            for t in store.values():
                t[targets, :, :n] = t[sources, :, :n]
        for store in (self.conv, self.recurrent):
            for t in store.values():
                t[targets] = t[sources]
        lengths = [self.lengths[r] for r in sources]
        for row, length in zip(targets, lengths):
            self.lengths[row] = length

    def clear_lengths(self, rows: range | list[int]) -> None:
        for row in rows:
            self.lengths[row] = 0

    def ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for store in (self.keys, self.values):
            for layer, t in store.items():
                grown = t.new_zeros((*t.shape[:2], capacity, t.shape[3]))
                grown[:, :, : self.capacity] = t
                store[layer] = grown
        self.capacity = capacity

    # -- lazily allocated tensors -----------------------------------------------------------

    def _kv(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            shape = (self.max_slots, like.shape[1], self.capacity, like.shape[3])
            self.keys[layer] = like.new_zeros(shape)
            self.values[layer] = like.new_zeros(shape)
        return self.keys[layer], self.values[layer]

    def _state(self, store: dict[int, torch.Tensor], layer: int, like: torch.Tensor) -> torch.Tensor:
        if layer not in store:
            store[layer] = like.new_zeros((self.max_slots, *like.shape[1:]))
        return store[layer]


class _LinearLayerView:
    """What transformers < 5.24 reads from ``cache.layers[i]`` of a linear-attention layer
    (``record_past``, ``conv_states[0]``, ``recurrent_states[0]``); later versions call the
    cache's ``is_recording_past`` / ``get_conv_state`` / ``get_recurrent_state`` instead."""

    def __init__(self, cache: StepCache, layer_idx: int) -> None:
        self.record_past = cache.is_recording_past(layer_idx)
        self.conv_states = [cache.get_conv_state(layer_idx)]
        self.recurrent_states = [cache.get_recurrent_state(layer_idx)]


class _LayerViews:
    """Indexable like ``Cache.layers`` but empty when iterated or measured, as ``layers=[]`` is
    in later versions (masking code iterates ``cache.layers`` for per-layer attributes)."""

    def __init__(self, cache: StepCache) -> None:
        self._cache = cache

    def __getitem__(self, layer_idx: int) -> _LinearLayerView:
        return _LinearLayerView(self._cache, layer_idx)

    def __iter__(self) -> Iterator[_LinearLayerView]:
        return iter(())

    def __len__(self) -> int:
        return 0


class StepCache(Cache):
    """The cache object of one forward pass over rows of a :class:`SlotStore`."""

    def __init__(self, store: SlotStore, *, prefill_row: int | None, query_len: int, rows: int = 1) -> None:
        super().__init__(layers=[])
        self.layers = _LayerViews(self)  # type: ignore[assignment]  # a stand-in for the list: see _LayerViews
        self.store = store
        self.prefill_row = prefill_row
        self.query_len = query_len
        self.rows = 1 if prefill_row is not None else rows
        self._decode_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (row index, position) per row

    # -- attention layers -------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.store._kv(layer_idx, key_states)
        if self.prefill_row is not None:
            r, q = self.prefill_row, self.query_len
            keys[r, :, :q] = key_states[0]
            values[r, :, :q] = value_states[0]
            return keys[r : r + 1, :, :q], values[r : r + 1, :, :q]
        rows, positions = self._decode_index(key_states.device)
        keys[rows, :, positions] = key_states[:, :, 0]
        values[rows, :, positions] = value_states[:, :, 0]
        span = max(self.store.lengths[: self.rows]) + 1
        return keys[: self.rows, :, :span], values[: self.rows, :, :span]

    def _decode_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._decode_rows is None:
            self._decode_rows = (
                torch.arange(self.rows, device=device),
                torch.tensor(self.store.lengths[: self.rows], device=device),
            )
        return self._decode_rows

    # -- linear-attention layers ------------------------------------------------------------

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if self.prefill_row is not None:
            return None  # a fresh sequence: no previous window
        return self.store.conv[layer_idx][: self.rows]

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        # Only called for a multi-token forward, i.e. a prefill (decode updates the window in place).
        if self.prefill_row is None:
            raise RuntimeError("a decode step must update the conv window in place")
        kernel = conv_kernel_size or conv_states.shape[-1]
        window = conv_states[..., -kernel:]
        if window.shape[-1] < kernel:
            window = torch.nn.functional.pad(window, (kernel - window.shape[-1], 0))
        store = self.store._state(self.store.conv, layer_idx, window)
        store[self.prefill_row] = window[0]
        return conv_states

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if self.prefill_row is not None:
            return None
        return self.store.recurrent[layer_idx][: self.rows]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        store = self.store._state(self.store.recurrent, layer_idx, recurrent_states)
        if self.prefill_row is not None:
            store[self.prefill_row] = recurrent_states[0]
            return store[self.prefill_row : self.prefill_row + 1]
        store[: self.rows] = recurrent_states
        return store[: self.rows]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """No intermediate recurrent states: this cache never rolls back (transformers >= 5.25 asks)."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """A decode step's token, counted where transformers' own caches count it (>= 5.25 calls this
        when the convolution window is updated in place); this cache counts it in :meth:`commit`."""

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.prefill_row is None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("StepCache callers pass explicit position_ids and masks")

    # -- inputs for the forward -------------------------------------------------------------

    def commit(self) -> None:
        """Record that the forward stored its tokens (call after the forward returns)."""
        if self.prefill_row is not None:
            self.store.lengths[self.prefill_row] = self.query_len
        else:
            for r in range(self.rows):
                self.store.lengths[r] += 1

    def position_ids(self, device: torch.device) -> torch.Tensor:
        if self.prefill_row is not None:
            return torch.arange(self.query_len, device=device)[None]
        return self._decode_index(device)[1][:, None]

    def attention_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive 4D mask ``[batch, 1, query, keys]``: 0 where attention is allowed."""
        blocked = torch.finfo(dtype).min
        if self.prefill_row is not None:
            q = self.query_len
            allowed = torch.ones(q, q, dtype=torch.bool, device=device).tril()
            return torch.zeros(1, 1, q, q, dtype=dtype, device=device).masked_fill(~allowed, blocked)
        positions = self._decode_index(device)[1]
        span = int(positions.max()) + 1
        allowed = torch.arange(span, device=device)[None, :] <= positions[:, None]
        mask = torch.zeros(self.rows, 1, 1, span, dtype=dtype, device=device)
        return mask.masked_fill(~allowed[:, None, None, :], blocked)
