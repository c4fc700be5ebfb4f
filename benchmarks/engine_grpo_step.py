"""The rollout of one GRPO step: ``Engine.generate`` vs one batched ``model.generate`` call.

The step of ``benchmarks/rl_vs_trl.py``: the 55 prompts "a+b=" (single digits, a + b <= 9) of the
char model (:func:`miles_core.assets.char_model.write_char_model`, fp32, one torch thread), each
sampled ``--samples`` times (default 8: 440 requests) at temperature 1, every sample with its own
seed. Per ``--max-tokens`` value (default 1, the race's, and 16):

* the engine: ``Engine.generate`` of the 440 requests (what the direct rollout calls), with
  ``max_batch_size`` as ``miles train`` sizes it (``min(256, requests)``; ``--max-batch-size``
  changes it: a one-token request needs no decode row, longer ones decode in waves of that many);
* one batched ``model.generate`` call over the same 440 rows (how TRL's GRPOTrainer generates a
  step: every prompt repeated ``num_generations`` times in one batch), EOS ignored on both sides.

Interleaved over ``--repeats`` rounds in one process; one JSON line per case with the medians
(ms per step's rollout), the ratio engine / generate (lower is better) and the 1-minute load.

    python benchmarks/engine_grpo_step.py [--max-tokens 1 16] [--samples 8] [--repeats 20] [--max-batch-size N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (default: 8)")
    parser.add_argument("--repeats", type=int, default=20, help="interleaved rounds per case (default: 20)")
    parser.add_argument("--max-batch-size", type=int, help="engine decode rows (default: min(256, requests), as miles train)")
    args = parser.parse_args()

    import torch

    from miles_core.assets.char_model import write_char_model
    from miles_core.engine.engine import Engine, EngineConfig
    from miles_core.engine.loader import load_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="grpo-step-") as tmp:
        loaded = load_model(write_char_model(Path(tmp) / "char"), dtype="float32", device="cpu")
    tokenizer = loaded.tokenizer
    prompts = [tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"] for a in range(10) for b in range(10) if a + b <= 9]
    rows = [p for p in prompts for _ in range(args.samples)]
    engine = Engine(loaded, EngineConfig(max_batch_size=args.max_batch_size or min(256, len(rows))), name="char")
    try:
        for max_tokens in args.max_tokens:
            run_engine(engine, rows, max_tokens, 0), run_generate(loaded.model, rows, max_tokens, 0)  # warm-up
            engine_s: list[float] = []
            generate_s: list[float] = []
            loads = []
            for round_ in range(1, args.repeats + 1):  # alternating which side runs first
                loads.append(round(os.getloadavg()[0], 2))
                if round_ % 2:
                    engine_s.append(run_engine(engine, rows, max_tokens, round_))
                    generate_s.append(run_generate(loaded.model, rows, max_tokens, round_))
                else:
                    generate_s.append(run_generate(loaded.model, rows, max_tokens, round_))
                    engine_s.append(run_engine(engine, rows, max_tokens, round_))
            line = _line(args, max_tokens, len(rows), engine_s, generate_s, loads)
            print(json.dumps({**line, "engine_max_batch_size": engine.config.max_batch_size}), flush=True)
    finally:
        engine.close()


def run_engine(engine: Any, rows: list[list[int]], max_tokens: int, round_: int) -> float:
    """Seconds for ``Engine.generate`` of one request per row, each with its own seed."""
    from miles_core.engine.base import GenerationRequest, SamplingParams

    base = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    requests = [GenerationRequest(p, base.with_seed(round_ * len(rows) + i)) for i, p in enumerate(rows)]
    started = time.perf_counter()
    completions = engine.generate(requests)
    seconds = time.perf_counter() - started
    assert all(c.completion_tokens == max_tokens for c in completions)
    return seconds


def run_generate(model: Any, rows: list[list[int]], max_tokens: int, round_: int) -> float:
    """Seconds for one batched ``model.generate`` call over ``rows`` (all of one length: no padding)."""
    import torch

    torch.manual_seed(round_)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor(rows), attention_mask=torch.ones(len(rows), len(rows[0]), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    seconds = time.perf_counter() - started
    assert out.shape == (len(rows), len(rows[0]) + max_tokens)
    return seconds


def _line(args: argparse.Namespace, max_tokens: int, requests: int, engine_s: list[float], generate_s: list[float],
          loads: list[float]) -> dict[str, Any]:
    import torch
    import transformers

    e, g = statistics.median(engine_s), statistics.median(generate_s)
    return {
        "benchmark": "engine_grpo_step",
        "model": "char (2 layers, hidden 64, fp32, CPU, 1 thread)",
        "requests": requests,
        "samples_per_prompt": args.samples,
        "max_tokens": max_tokens,
        "engine_ms": round(1e3 * e, 2),
        "engine_ms_min": round(1e3 * min(engine_s), 2),
        "generate_ms": round(1e3 * g, 2),
        "generate_ms_min": round(1e3 * min(generate_s), 2),
        "ratio": round(e / g, 3),
        "repeats": len(engine_s),
        "load_avg_1m": [min(loads), max(loads)],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


if __name__ == "__main__":
    main()
