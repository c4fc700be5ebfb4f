"""CUDA graphs of the lean decode step, one per (batch bucket, attention-span bucket).

A decode step of ``n`` rows replays the graph captured for the smallest bucket ``B >= n`` (rows
``[n, B)`` are free rows: they compute on garbage and their lengths are zeroed again after the
replay) and the smallest power-of-two span covering the longest row. Without capture
(``cuda_graphs=False``) the step runs eagerly on the same padded shapes, so both paths launch the
same kernels on the same inputs and give the same tokens. A graph is captured the
first time its key is needed, the way PyTorch documents it: the step runs eagerly on a side
stream first (that run *is* the step: its logits are returned, and it warms up cuBLAS and
Triton), then the same call is recorded into the graph (recording executes nothing). All graphs
share one memory pool and are replayed one at a time.

Graphs read the model's parameters and the :class:`~miles_core.engine.state.SlotState` tensors by
address: weight updates copy in place (addresses kept); when the state reallocates (KV capacity
growth bumps ``state.generation``) every graph is dropped and recaptured on demand, into a new
pool: the dropped graphs release theirs, and PyTorch's allocator refuses a capture into a released
pool while a tensor of it is still alive (an overlapped step's logits are).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from miles_core.engine.state import SlotState

DecodeFn = Callable[[SlotState, torch.Tensor, int], torch.Tensor]


def batch_buckets(max_rows: int, min_rows: int = 1) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 256, multiples of 32 beyond, and ``max_rows`` itself;
    none below ``min_rows`` (unless ``max_rows`` is)."""
    sizes = {1, 2, 4, *range(8, 257, 8), *range(288, max_rows + 1, 32), max_rows}
    return sorted(s for s in sizes if min(min_rows, max_rows) <= s <= max_rows)


class DecodeGraphs:
    """Decode steps on graph buckets; ``runtime`` is the device's graph API
    (:func:`miles_core.hardware.devices.graph_runtime`)."""

    def __init__(self, decode: DecodeFn, state: SlotState, runtime: Any, *, capture: bool = True,
                 min_span: int = 64, min_rows: int = 1) -> None:
        self.runtime = runtime
        self.decode = decode
        self.state = state
        self.capture = capture
        self.buckets = batch_buckets(state.max_slots, min_rows)
        self.min_span = min_span
        self.ids = torch.zeros(state.max_slots, dtype=torch.long, device=state.device)
        self.pool = self._new_pool()
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.generation = state.generation
        self.captures = 0
        self.replays = 0

    def _new_pool(self) -> Any:
        with self.runtime.device(self.state.device):
            return self.runtime.graph_pool_handle()

    def key(self, n: int, span: int) -> tuple[int, int]:
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        graph_span = self.min_span
        while graph_span < span:
            graph_span *= 2
        return bucket, min(graph_span, self.state.capacity)

    def run(self, ids: torch.Tensor, span: int) -> torch.Tensor:
        """Logits ``[n, vocab]`` of one decode step of rows ``[0, n)`` (``n = len(ids)``)."""
        if self.state.generation != self.generation:
            self.graphs.clear()
            self.pool = self._new_pool()
            self.generation = self.state.generation
        n = ids.shape[0]
        bucket, graph_span = self.key(n, span)
        self.ids[:n].copy_(ids)
        entry = self.graphs.get((bucket, graph_span))
        if not self.capture:
            logits = self.decode(self.state, self.ids[:bucket], graph_span)
        elif entry is None:
            logits = self._capture(bucket, graph_span)
        else:
            entry[0].replay()
            logits = entry[1]
            self.replays += 1
        if bucket > n:
            self.state.lengths[n:bucket].zero_()
        return logits[:n]

    def _capture(self, bucket: int, span: int) -> torch.Tensor:
        current = self.runtime.current_stream()
        side = self.runtime.Stream()
        side.wait_stream(current)
        with self.runtime.stream(side):
            logits = self.decode(self.state, self.ids[:bucket], span)
        current.wait_stream(side)
        logits.record_stream(current)
        graph = self.runtime.CUDAGraph()
        # thread-local: another thread of this process (an in-process trainer) may use the device meanwhile
        with self.runtime.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            static_logits = self.decode(self.state, self.ids[:bucket], span)
        self.graphs[(bucket, span)] = (graph, static_logits)
        self.captures += 1
        return logits
