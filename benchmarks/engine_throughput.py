"""Generated tokens/s: the embedded engine (64 concurrent requests) vs sequential ``model.generate``.

Both sides use the same model, the same prompts and the same settings (sampling at temperature 1
with no top-k/top-p, exactly ``--max-tokens`` new tokens per request: EOS is ignored), measured in
the same run. Prints one JSON line; ``ratio`` is engine tokens/s over baseline tokens/s.

    python benchmarks/engine_throughput.py [--preset tiny] [--requests 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="engine preset to measure (default: tiny)")
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests (default: 64)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--prompt-len", type=int, default=32, help="mean prompt length in tokens (default: 32)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    args = parser.parse_args()

    import torch

    from miles_core.engine.base import GenerationRequest, SamplingParams
    from miles_core.engine.engine import Engine, EngineConfig

    engine = Engine.from_preset(args.preset, EngineConfig(max_batch_size=args.requests, device=args.device))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(256) for _ in range(rng.randint(args.prompt_len // 2, args.prompt_len * 3 // 2))]
        for _ in range(args.requests)
    ]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(args.requests)]
    requests = [GenerationRequest(p, s) for p, s in zip(prompts, params)]

    engine.generate(requests[:2])  # warm-up: first-call allocations and kernel selection
    started = time.perf_counter()
    completions = engine.generate(requests)
    engine_seconds = time.perf_counter() - started
    engine_tokens = sum(c.completion_tokens for c in completions)

    model = engine.model
    generate_kwargs = dict(
        max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0
    )
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]], device=engine.device), **generate_kwargs)  # warm-up
        started = time.perf_counter()
        baseline_tokens = 0
        for prompt in prompts:
            ids = torch.tensor([prompt], device=engine.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **generate_kwargs)
            baseline_tokens += out.shape[1] - ids.shape[1]
        baseline_seconds = time.perf_counter() - started
    engine.close()

    engine_tps = engine_tokens / engine_seconds
    baseline_tps = baseline_tokens / baseline_seconds
    print(
        json.dumps(
            {
                "benchmark": "engine_throughput",
                "preset": args.preset,
                "device": str(engine.device),
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "engine_tokens": engine_tokens,
                "engine_seconds": round(engine_seconds, 3),
                "engine_tokens_per_s": round(engine_tps, 1),
                "baseline": "sequential model.generate",
                "baseline_tokens": baseline_tokens,
                "baseline_seconds": round(baseline_seconds, 3),
                "baseline_tokens_per_s": round(baseline_tps, 1),
                "ratio": round(engine_tps / baseline_tps, 2),
                "target_ratio": 3.0,
            }
        )
    )


if __name__ == "__main__":
    main()
