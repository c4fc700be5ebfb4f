"""Ways to run a packed GDN prefill's recurrence, side by side (what sets the engine's
``RECURRENT_PREFILL_WIDTH`` / ``RECURRENT_PREFILL_TOKENS``).

For 64 segments of each length range (``--ranges``), one layer at the ``small-gpu`` preset's GDN
shape, packed with ``cu_seqlens`` and one fp32 initial state per segment, the same inputs go to
fla's chunked kernel (``chunk_gated_delta_rule``, the peer: what fla recommends for prefill), to
fla's fused recurrent kernel as the engine launches it (``recurrent``: the states updated in
place, the engine's value tile), and through fla's public recurrent entry point (``fla_recurrent``:
a new final state, fla's tile), alternated call by call. One JSON line per range: the median host
time of a call (to return), its wall time (to a sync) and its GPU time (20 calls queued behind a
sleep kernel, so the host cannot be the bound), for each; ``ratio`` = the engine's recurrent wall /
chunked wall (below 1: the recurrent kernel is faster); and the largest differences of outputs
and final states between the chunked and the engine's recurrent run. ``--fresh``: every segment
starts over (a batch of new requests): no initial state for fla's two entry points, ``fresh=True``
for the engine's step (whose stored states then hold NaN, which must not reach its outputs). Needs
CUDA and fla.

    python benchmarks/gdn_prefill_kernels.py [--ranges 16-48 100-300 500-1500] [--segments 64] [--fresh]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date
from typing import Any

import torch


def _parse_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    if not sep or not lo.isdigit() or not hi.isdigit() or not 0 < int(lo) <= int(hi):
        raise argparse.ArgumentTypeError(f"{text!r}: a range is LOW-HIGH with 0 < LOW <= HIGH (e.g. 16-48)")
    return int(lo), int(hi)


def _times(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Median host and wall milliseconds of one call."""
    host, wall = [], []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append(1e3 * (returned - start))
        wall.append(1e3 * (done - start))
    return statistics.median(host), statistics.median(wall)


def _gpu_ms(fn: Callable[[], Any], calls: int) -> float:
    """GPU milliseconds of one call, the calls queued behind a sleep kernel so the host keeps ahead."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def measure(lo: int, hi: int, args: argparse.Namespace) -> dict[str, Any]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from miles_core.engine import gdn_ops

    rng = random.Random(args.seed)
    lengths = [rng.randint(lo, hi) for _ in range(args.segments)]
    tokens = sum(lengths)
    cu_seqlens_cpu = torch.tensor([0, *itertools.accumulate(lengths)])
    cu_seqlens = cu_seqlens_cpu.cuda()
    torch.manual_seed(args.seed)
    bf16: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(1, tokens, args.key_heads, args.head_dim, **bf16)
    k = torch.randn(1, tokens, args.key_heads, args.head_dim, **bf16)
    v = torch.randn(1, tokens, args.value_heads, args.head_dim, **bf16)
    g = -0.5 * torch.rand(1, tokens, args.value_heads, device="cuda")
    beta = torch.rand(1, tokens, args.value_heads, **bf16)
    initial = 0.1 * torch.randn(args.segments, args.value_heads, args.head_dim, args.head_dim, device="cuda")
    common = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": args.head_dim**-0.5,
              "initial_state": None if args.fresh else initial,
              "output_final_state": True, "use_qk_l2norm_in_kernel": True, "cu_seqlens": cu_seqlens}

    def chunked() -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_gated_delta_rule(**common, cu_seqlens_cpu=cu_seqlens_cpu)

    step = gdn_ops.fla_recurrent_step()
    stored = torch.full_like(initial, float("nan")) if args.fresh else initial
    states = stored.clone()

    def recurrent() -> tuple[torch.Tensor, torch.Tensor]:  # the timed calls keep updating one set of states
        return step(q[0], k[0], v[0], g[0], beta[0], states, cu_seqlens, fresh=args.fresh), states

    def fla_recurrent() -> tuple[torch.Tensor, torch.Tensor]:
        return fused_recurrent_gated_delta_rule(**common)

    kernels = {"chunk": chunked, "recurrent": recurrent, "fla_recurrent": fla_recurrent}
    for fn in kernels.values():  # compile and warm both before any timing
        for _ in range(3):
            fn()
    samples: dict[str, dict[str, list[float]]] = {name: {"host": [], "wall": [], "gpu": []} for name in kernels}
    for _ in range(args.rounds):  # interleaved, so a drift of the machine hits both
        for name, fn in kernels.items():
            host, wall = _times(fn, args.calls)
            samples[name]["host"].append(host)
            samples[name]["wall"].append(wall)
            samples[name]["gpu"].append(_gpu_ms(fn, args.calls))
    states.copy_(stored)
    (out_c, final_c), (out_r, final_r) = chunked(), recurrent()
    torch.cuda.synchronize()
    result: dict[str, Any] = {"benchmark": "gdn_prefill_kernels", "segments": args.segments, "lengths": f"{lo}-{hi}",
                              "tokens": tokens, "fresh": args.fresh}
    for name, by_kind in samples.items():
        for kind, values in by_kind.items():
            result[f"{name}_{kind}_ms"] = round(statistics.median(values), 4)
    result["ratio"] = round(result["recurrent_wall_ms"] / result["chunk_wall_ms"], 3)
    result["outputs_max_abs_diff"] = float((out_c.float() - out_r.float()).abs().max())
    result["outputs_scale"] = float(out_c.float().abs().max())
    result["final_states_max_abs_diff"] = float((final_c - final_r).abs().max())
    result.update(device=torch.cuda.get_device_name(), torch=torch.__version__, date=date.today().isoformat())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranges", type=_parse_range, nargs="+", default=[(16, 48), (100, 300), (500, 1500)],
                        help="segment length ranges, LOW-HIGH tokens (default: 16-48 100-300 500-1500)")
    parser.add_argument("--segments", type=int, default=64, help="segments per prefill (default: 64)")
    parser.add_argument("--key-heads", type=int, default=8, help="default: small-gpu's 8")
    parser.add_argument("--value-heads", type=int, default=16, help="default: small-gpu's 16")
    parser.add_argument("--head-dim", type=int, default=128, help="key and value head dim (default: small-gpu's 128)")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per kernel and round (default: 20)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--fresh", action="store_true", help="every segment starts over (no initial state)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.segments, args.key_heads, args.value_heads, args.head_dim, args.calls, args.rounds) < 1:
        parser.error("--segments, --key-heads, --value-heads, --head-dim, --calls and --rounds must be >= 1")
    if not torch.cuda.is_available():
        print("gdn_prefill_kernels: needs a CUDA device (fla's kernels are Triton)", file=sys.stderr)
        return 2
    try:
        import fla  # noqa: F401
    except ImportError:
        print("gdn_prefill_kernels: needs fla (pip install flash-linear-attention)", file=sys.stderr)
        return 2
    for lo, hi in args.ranges:
        print(json.dumps(measure(lo, hi, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
