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
growth bumps ``state.generation``) every graph is dropped and recaptured on demand.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from miles_core.engine.state import SlotState

DecodeFn = Callable[[SlotState, torch.Tensor, int], torch.Tensor]


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 256, multiples of 32 beyond, and ``max_rows`` itself."""
    sizes = {1, 2, 4, *range(8, 257, 8), *range(288, max_rows + 1, 32), max_rows}
    return sorted(s for s in sizes if s <= max_rows)


class DecodeGraphs:
    def __init__(self, decode: DecodeFn, state: SlotState, *, capture: bool = True, min_span: int = 64) -> None:
        if state.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.decode = decode
        self.state = state
        self.capture = capture
        self.buckets = batch_buckets(state.max_slots)
        self.min_span = min_span
        self.ids = torch.zeros(state.max_slots, dtype=torch.long, device=state.device)
        with torch.cuda.device(state.device):
            self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.generation = state.generation
        self.captures = 0
        self.replays = 0

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
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            logits = self.decode(self.state, self.ids[:bucket], span)
        current.wait_stream(side)
        logits.record_stream(current)
        graph = torch.cuda.CUDAGraph()
        # thread-local: another thread of this process (an in-process trainer) may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            static_logits = self.decode(self.state, self.ids[:bucket], span)
        self.graphs[(bucket, span)] = (graph, static_logits)
        self.captures += 1
        return logits
