"""Shared-prompt groups as one masked attention block or per segment (what sets the packed
attention's ``GROUP_BLOCK_MAX_TOKENS``).

A packed row of groups (a prompt of ``P`` tokens, then ``n`` responses of ``L`` tokens each, the
first one laid out with the prompt and the others as branches of it) goes through the packed
attention's ``_per_document`` forward and backward two ways, alternated call by call: ``block``,
each group one query block under the group mask (the path the packed attention takes up to
``GROUP_BLOCK_MAX_TOKENS``), and ``segments``, the prompt and its first response as one causal call
and the other responses as one masked call per length, each gathering its prompt's keys (the path
beyond it). One JSON line per shape: the median microseconds of each and ``ratio`` = block /
segments (below 1: the block is faster). 4 query heads, 2 key/value heads of 16 (the char model of
``rl_vs_trl.py``), fp32, one thread, on the CPU unless ``--device cuda``.

    python benchmarks/group_attention.py [--shapes PxNxL ...] [--rounds 30] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date

import torch

from miles_core.patches import attention
from miles_core.patches.packing import packed_sequences

HEADS, KV_HEADS, DIM = 4, 2, 16
ROW_TOKENS = 660  # about one rl_vs_trl step's row: 55 groups of 12 tokens


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is PxNxL, three positive integers (e.g. 4x8x1)")
    prefix, responses, length = map(int, parts)
    return prefix, responses, length


def _row(prefix: int, responses: int, length: int, groups: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    span = prefix + responses * length
    positions: list[int] = []
    branches = []
    for g in range(groups):
        root = g * span
        positions += list(range(prefix + length)) + list(range(prefix, prefix + length)) * (responses - 1)
        branches += [(root + prefix + r * length, root, prefix) for r in range(1, responses)]
    return torch.tensor([positions]), branches


def _step(tensors: tuple[torch.Tensor, ...], positions: torch.Tensor, branches: list[tuple[int, int, int]],
          block_limit: int) -> float:
    """Microseconds of one forward and backward with the block path allowed up to ``block_limit``
    tokens; a fresh packing context each call, since the plan is part of what a forward pays once."""
    q, k, v = tensors
    limit = attention.GROUP_BLOCK_MAX_TOKENS
    attention.GROUP_BLOCK_MAX_TOKENS = block_limit
    try:
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        started = time.perf_counter()
        ctx = packed_sequences(positions, branches=branches)
        if ctx is None:
            raise ValueError("the row holds a single document (one group of one response): nothing is packed")
        attention._per_document(q, k, v, ctx, DIM**-0.5, 0.0).sum().backward()
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        return (time.perf_counter() - started) * 1e6
    finally:
        attention.GROUP_BLOCK_MAX_TOKENS = limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=_shape, nargs="+",
                        default=[(4, 8, 1), (16, 8, 4), (32, 8, 4), (32, 8, 8), (16, 8, 16), (64, 8, 16), (128, 8, 128)],
                        help="groups as PROMPTxRESPONSESxLENGTH (default: 4x8x1 ... 128x8x128)")
    parser.add_argument("--rounds", type=int, default=30, help="alternated calls per path (default: 30)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    for prefix, responses, length in args.shapes:
        span = prefix + responses * length
        groups = max(1, ROW_TOKENS // span)
        positions, branches = _row(prefix, responses, length, groups)
        tokens = positions.shape[1]
        generator = torch.Generator().manual_seed(0)
        tensors = tuple(torch.randn(tokens, heads, DIM, generator=generator).to(device).requires_grad_()
                        for heads in (HEADS, KV_HEADS, KV_HEADS))
        row = (tensors, positions.to(device), branches)
        limits = {True: span, False: span - 1}  # the block path taken, or just not
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(3):  # warm-up
            for block in (True, False):
                _step(*row, limits[block])
        for _ in range(args.rounds):
            for block in (True, False):
                times[block].append(_step(*row, limits[block]))
        block_us, segments_us = statistics.median(times[True]), statistics.median(times[False])
        print(json.dumps({
            "benchmark": "group_attention", "prompt": prefix, "responses": responses, "length": length,
            "group_tokens": span, "groups": groups, "device": str(device),
            "block_us": round(block_us), "segments_us": round(segments_us), "ratio": round(block_us / segments_us, 3),
            "block_path_taken": span <= attention.GROUP_BLOCK_MAX_TOKENS, "torch": torch.__version__, "date": date.today().isoformat(),
        }), flush=True)


if __name__ == "__main__":
    main()
