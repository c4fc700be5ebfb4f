"""Generated tokens/s of the embedded engine vs Hugging Face ``generate`` on the same model object.

For each number of concurrent requests (``--requests``, default 8, 64 and 256) and each length
mix (``equal``: exactly ``--max-tokens`` new tokens each, EOS ignored; ``mixed``: ``max_tokens``
drawn uniformly from ``--mixed-min``..``--mixed-max`` per request, EOS respected), one JSON line
compares, in the same run and interleaved over ``--repeats`` rounds:

* the engine: every request submitted at once (``Engine.submit_many``, continuous batching,
  ``max_batch_size`` = the number of requests);
* **one padded batched ``model.generate`` call** (the headline ``ratio``): left-padded prompts,
  ``max_new_tokens`` = the longest request's, each row stopped at its own ``max_tokens`` by a
  stopping criterion (later positions are padding and not counted), EOS as the engine has it;
* sequential ``model.generate``, one request at a time (secondary ``ratio_vs_sequential``), over
  the first ``--sequential-requests`` requests (its tokens/s does not depend on how many run).

Same prompts (random byte tokens, ``--prompt-min``..``--prompt-max`` long), same sampling
(temperature 1, no top-k/top-p) on every side. Tokens/s counts generated tokens over wall time
from submission to the last completion; ``ms_per_step`` is the decode phase (after every request
has its first token) over the decode steps; ``ttft_ms`` is the mean time from submission to a
request's first token. Medians over the repeats; ``ratio_min`` is the worst repeat.

    python benchmarks/engine_throughput.py [--preset tiny] [--device cpu|cuda] [--requests 8 64 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Run:
    tokens: int
    seconds: float
    ms_per_step: float
    ttft_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(engine: Any, requests: list[Any]) -> Run:
    before = engine.stats()
    started = time.perf_counter()
    completions = [f.result() for f in engine.submit_many(requests)]
    seconds = time.perf_counter() - started
    steps = engine.stats()["decode_steps"] - before["decode_steps"]
    last_first = max(c.timing.first_token_s for c in completions)
    return Run(
        tokens=sum(c.completion_tokens for c in completions),
        seconds=seconds,
        ms_per_step=1e3 * (seconds - last_first) / max(steps, 1),
        ttft_ms=1e3 * statistics.fmean(c.timing.first_token_s for c in completions),
    )


class _StepClock:
    """A ``generate`` streamer that only records when each step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(model: Any, prompts: list[list[int]], limits: list[int], *, equal: bool, eos: set[int], pad: int) -> tuple[int, _StepClock]:
    """One padded ``generate`` call; returns the tokens that count (per row: up to its limit or EOS)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    limit = torch.tensor(limits, device=device)

    class RowLimits(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return (input_ids.shape[1] - width) >= limit

    clock = _StepClock()
    longest = max(limits)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=longest, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad,
        stopping_criteria=StoppingCriteriaList([RowLimits()]), streamer=clock,
    )
    if equal:
        kwargs.update(min_new_tokens=longest, eos_token_id=None)
    else:
        kwargs.update(eos_token_id=sorted(eos))
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    _sync(device)
    tokens = 0
    for row, n in zip(out[:, width:].tolist(), limits):
        row = row[:n]
        if not equal:
            stop = next((i for i, t in enumerate(row) if t in eos), None)
            row = row if stop is None else row[: stop + 1]
        tokens += len(row)
    return tokens, clock


def run_batched_generate(model: Any, prompts: list[list[int]], limits: list[int], **kw: Any) -> Run:
    started = time.perf_counter()
    tokens, clock = _generate(model, prompts, limits, **kw)
    seconds = time.perf_counter() - started
    first = clock.times[1] - started  # times[0]: the prompt itself
    steps = len(clock.times) - 2
    return Run(tokens, seconds, 1e3 * (clock.times[-1] - clock.times[1]) / max(steps, 1), 1e3 * first)


def run_sequential_generate(model: Any, prompts: list[list[int]], limits: list[int], **kw: Any) -> Run:
    started = time.perf_counter()
    tokens, firsts, step_ms = 0, [], []
    for prompt, limit in zip(prompts, limits):
        n, clock = _generate(model, [prompt], [limit], **kw)
        tokens += n
        firsts.append(clock.times[1] - started)
        if len(clock.times) > 2:
            step_ms.append(1e3 * (clock.times[-1] - clock.times[1]) / (len(clock.times) - 2))
    seconds = time.perf_counter() - started
    return Run(tokens, seconds, statistics.fmean(step_ms) if step_ms else float("nan"), 1e3 * statistics.fmean(firsts))


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="engine preset to measure (default: tiny)")
    parser.add_argument("--model-path", help="a model directory instead of a preset")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (default: auto)")
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 64, 256], help="concurrent requests (default: 8 64 256)")
    parser.add_argument("--lengths", nargs="+", choices=["equal", "mixed"], default=["equal", "mixed"])
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request, equal lengths (default: 64)")
    parser.add_argument("--mixed-min", type=int, default=8, help="shortest max_tokens, mixed lengths (default: 8)")
    parser.add_argument("--mixed-max", type=int, default=256, help="longest max_tokens, mixed lengths (default: 256)")
    parser.add_argument("--prompt-min", type=int, default=16, help="shortest prompt in tokens (default: 16)")
    parser.add_argument("--prompt-max", type=int, default=48, help="longest prompt in tokens (default: 48)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per case (default: 3)")
    parser.add_argument("--sequential-requests", type=int, default=8,
                        help="requests the sequential baseline runs (0: skip it; default: 8)")
    parser.add_argument("--runner", default="auto", help="engine runner: auto, lean or hf (default: auto)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the engine's decode step eagerly on a GPU")
    parser.add_argument("--no-compile", action="store_true", help="do not torch.compile the decode step on a GPU")
    parser.add_argument("--no-overlap", action="store_true",
                        help="read each decode step's tokens before launching the next (the GPU default overlaps them)")
    parser.add_argument("--gdn-state-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="storage of the engine's GDN recurrent states (default: float32)")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from miles_core.engine.base import GenerationRequest, SamplingParams
    from miles_core.engine.engine import Engine, EngineConfig
    from miles_core.engine.loader import load_model
    from miles_core.engine.presets import preset_dir

    torch.set_num_threads(args.cpu_threads)
    path = args.model_path or preset_dir(args.preset)
    loaded = load_model(path, dtype=args.dtype, device=args.device)
    model = loaded.model
    device = next(model.parameters()).device
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    eos = set(loaded.eos_token_ids)
    vocab = min(256, model.config.get_text_config().vocab_size)

    started = time.perf_counter()
    for n in args.requests:
        _progress(started, f"{n} requests: building the engine")
        config = EngineConfig(max_batch_size=n, runner=args.runner, cuda_graphs=not args.no_cuda_graphs,
                              compile_decode=False if args.no_compile else None, cpu_threads=args.cpu_threads,
                              overlap_steps=False if args.no_overlap else None,
                              gdn_state_dtype=args.gdn_state_dtype)
        engine = Engine(loaded, config, name=args.model_path or args.preset)
        try:
            for lengths in args.lengths:
                rng = random.Random(f"{args.seed}-{n}-{lengths}")
                prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))] for _ in range(n)]
                equal = lengths == "equal"
                limits = [args.max_tokens if equal else rng.randint(args.mixed_min, args.mixed_max) for _ in range(n)]
                requests = [
                    GenerationRequest(p, SamplingParams(max_tokens=m, temperature=1.0, seed=i, ignore_eos=equal))
                    for i, (p, m) in enumerate(zip(prompts, limits))
                ]
                kw = dict(equal=equal, eos=eos, pad=pad)
                _progress(started, f"{n} x {lengths}: warm-up (on a fresh GPU machine it compiles for minutes)")
                warm_up = run_engine(engine, requests)  # allocations, kernel selection and compilation, graph capture
                run_batched_generate(model, prompts, limits, **kw)
                engine_runs, batched_runs = [], []
                loads = []
                _progress(started, f"{n} x {lengths}: measuring, engine and generate alternated {args.repeats} time(s)")
                for _ in range(args.repeats):
                    loads.append(_load_avg())
                    engine_runs.append(run_engine(engine, requests))
                    batched_runs.append(run_batched_generate(model, prompts, limits, **kw))
                sequential = None
                if args.sequential_requests:
                    k = min(args.sequential_requests, n)
                    sequential = run_sequential_generate(model, prompts[:k], limits[:k], **kw)
                line = _line(args, n, lengths, device, engine, engine_runs, batched_runs, sequential, loads)
                line["engine_warm_up_s"] = round(warm_up.seconds, 2)
                print(json.dumps(line), flush=True)
        finally:
            engine.close()


def _progress(started: float, message: str) -> None:
    """One line on stderr per phase (stdout carries only the JSON lines)."""
    print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)


def _median(runs: list[Run], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in runs)


def _line(args: argparse.Namespace, n: int, lengths: str, device: Any, engine: Any, engine_runs: list[Run],
          batched_runs: list[Run], sequential: Run | None, loads: list[float | None]) -> dict[str, Any]:
    import torch
    import transformers

    e_tps, g_tps = _median(engine_runs, "tokens_per_s"), _median(batched_runs, "tokens_per_s")
    line: dict[str, Any] = {
        "benchmark": "engine_throughput",
        "preset": args.model_path or args.preset,
        "device": str(device),
        "requests": n,
        "lengths": lengths,
        "max_tokens": args.max_tokens if lengths == "equal" else [args.mixed_min, args.mixed_max],
        "runner": engine.runner_info(),
        "engine_tokens_per_s": round(e_tps, 1),
        "engine_ms_per_step": round(_median(engine_runs, "ms_per_step"), 3),
        "engine_ttft_ms": round(_median(engine_runs, "ttft_ms"), 2),
        "engine_tokens": engine_runs[0].tokens,
        "baseline": "one padded batched model.generate call",
        "generate_tokens_per_s": round(g_tps, 1),
        "generate_ms_per_step": round(_median(batched_runs, "ms_per_step"), 3),
        "generate_ttft_ms": round(_median(batched_runs, "ttft_ms"), 2),
        "generate_tokens": batched_runs[0].tokens,
        "ratio": round(e_tps / g_tps, 2),
        "ratio_min": round(min(e.tokens_per_s / g.tokens_per_s for e, g in zip(engine_runs, batched_runs)), 2),
        "repeats": len(engine_runs),
    }
    if sequential is not None:
        line.update(
            sequential_requests=min(args.sequential_requests, n),
            sequential_tokens_per_s=round(sequential.tokens_per_s, 1),
            sequential_ms_per_step=round(sequential.ms_per_step, 3),
            ratio_vs_sequential=round(e_tps / sequential.tokens_per_s, 2),
        )
    line.update(
        load_avg_1m=[None if x is None else round(x, 2) for x in loads],
        torch=torch.__version__,
        transformers=transformers.__version__,
        date=time.strftime("%Y-%m-%d"),
    )
    return line


if __name__ == "__main__":
    main()
