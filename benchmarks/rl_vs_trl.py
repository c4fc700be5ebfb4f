"""TRL's GRPOTrainer vs miles (direct rollout path) on the same task, model and machine.

Task: the 55 prompts "a+b=" (single digits, a + b <= 9); reward 1 when the first generated token
is the digit of the sum. Model: the same random-init 2-layer, hidden-64 Llama-architecture causal
LM for both (same seed -> same weights), a character-level tokenizer, fp32, one torch thread.

Measured: training wall time from the first training step until greedy accuracy on all 55 prompts
reaches 0.9 (evaluation time excluded on both sides: the clock pauses while evaluating), median
over seeds; a seed that does not get there within the time cap counts as never reached
(collapsed). Each (framework, seed) runs in a fresh subprocess so neither inherits the other's
state. Prints one JSON line: per-framework runs, medians, never-reached counts, and
``ratio = miles median / TRL median`` (target <= 0.5).

    python benchmarks/rl_vs_trl.py [--seeds 0 1 2] [--cap-s 150]

Needs ``pip install -e ".[bench]"`` (trl 1.16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from miles_core.assets.char_model import write_char_model

TARGET = 0.9
MAX_NEW_TOKENS = 1  # the reward reads only the first generated token
GENERATIONS = 8
TRL_LR = 1e-3
TRL_COMPLETIONS_PER_STEP = 32
MILES_SETTINGS = {
    # every prompt every step (a 55-entry table learns in far fewer steps from full batches), and a
    # k3 KL to the starting policy instead of an entropy bonus against collapse
    "rollout": {"path": "direct", "prompts_per_step": 55, "samples_per_prompt": 8,
                "max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0},
    "algorithm": {"lr": 3e-3, "kl_coef": 0.3},
    "task": {"name": "arith-add", "reward": "miles_core.rl.builtin:first_token_reward"},
    "trainer": {"device": "cpu", "max_tokens_per_row": 512},
    "run": {"eval_every": 1, "stop_at_accuracy": TARGET, "progress": False, "plot": False},
}


def prompts() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10) if a + b <= 9]


# -- TRL ------------------------------------------------------------------------------------


def run_trl(model_dir: Path, seed: int, cap_s: float) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    items = prompts()
    answers = dict(items)

    def reward(prompts, completions, **_):
        return [1.0 if c[:1] == answers[p] else 0.0 for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def greedy_accuracy() -> float:
        model.eval()
        enc = tokenizer([p for p, _ in items], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=0)
        first = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:])
        model.train()
        return sum(f[:1] == a for f, (_, a) in zip(first, items)) / len(items)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.started = self.paused = 0.0
            self.steps = 0
            self.reached: float | None = None
            self.accuracy = 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps += 1
            pause = time.perf_counter()
            self.accuracy = greedy_accuracy()
            self.paused += time.perf_counter() - pause
            elapsed = time.perf_counter() - self.started - self.paused
            if self.accuracy >= TARGET:
                self.reached = elapsed
                control.should_training_stop = True
            elif elapsed > cap_s:
                control.should_training_stop = True

    clock = Clock()
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), learning_rate=TRL_LR, num_generations=GENERATIONS,
        per_device_train_batch_size=TRL_COMPLETIONS_PER_STEP, max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0, beta=0.0, max_steps=100_000, logging_steps=10_000, save_strategy="no",
        report_to="none", use_cpu=True, seed=seed, data_seed=seed, disable_tqdm=True, bf16=False,
        gradient_checkpointing=False,
    )
    dataset = Dataset.from_dict({"prompt": [p for p, _ in items] * 200})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    elapsed = time.perf_counter() - clock.started - clock.paused
    return {"seconds_to_target": clock.reached, "steps": clock.steps, "final_accuracy": clock.accuracy,
            "ms_per_step": 1000 * elapsed / max(clock.steps, 1)}


# -- miles ----------------------------------------------------------------------------------


def run_miles(model_dir: Path, seed: int, cap_s: float, out_dir: Path) -> dict:
    import torch

    torch.set_num_threads(1)
    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.config import load_config
    from miles_core.rl.loop import train

    config = load_config(overrides=[
        MILES_SETTINGS,
        {"model": {"path": str(model_dir), "preset": None}, "run": {"seed": seed, "out_dir": str(out_dir), "steps": 10_000}},
    ])
    result = train(config.model_copy(update={"run": config.run.model_copy(update={"time_limit_s": cap_s})}),
                   get_plugin_manager())
    training = sum(r["time_step"] - r.get("time_eval", 0.0) for r in result.records)
    steps = len(result.records)
    return {
        "seconds_to_target": training if result.stopped_early else None,
        "steps": steps,
        "final_accuracy": result.final_accuracy,
        "ms_per_step": 1000 * training / max(steps, 1),
        "max_logprob_mismatch": max((r["logprob_mismatch_max"] for r in result.records), default=None),
    }


# -- driver ---------------------------------------------------------------------------------


def worker(framework: str, seed: int, cap_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="rl-vs-trl-") as tmp:
        model_dir = write_char_model(Path(tmp) / "model", seed)
        if framework == "trl":
            return run_trl(model_dir, seed, cap_s)
        return run_miles(model_dir, seed, cap_s, Path(tmp) / "run")


def summarize(runs: list[dict]) -> dict:
    reached = [r["seconds_to_target"] for r in runs if r["seconds_to_target"] is not None]
    return {
        "median_s": statistics.median(reached) if reached else None,
        "never_reached": len(runs) - len(reached),
        "median_ms_per_step": statistics.median([r["ms_per_step"] for r in runs if r["ms_per_step"]] or [0]),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--cap-s", type=float, default=150.0, help="training-time cap per run (never reached past it)")
    parser.add_argument("--worker", choices=["trl", "miles"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.seed, args.cap_s)), flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, list[dict]] = {"trl": [], "miles": []}
    for framework in ("trl", "miles"):
        for seed in args.seeds:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", framework, "--seed", str(seed), "--cap-s", str(args.cap_s)],
                capture_output=True, text=True, env=env,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                sys.exit(f"{framework} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[framework].append({"seed": seed, **json.loads(line.removeprefix("RESULT "))})
    trl, miles = summarize(results["trl"]), summarize(results["miles"])
    ratio = miles["median_s"] / trl["median_s"] if miles["median_s"] and trl["median_s"] else None
    print(json.dumps({
        "benchmark": "rl_vs_trl", "target_accuracy": TARGET, "seeds": args.seeds,
        "trl": trl, "miles": miles, "ratio_miles_over_trl": ratio, "target_ratio": 0.5,
        "meets_target": ratio is not None and ratio <= 0.5 and miles["never_reached"] == 0,
    }))


if __name__ == "__main__":
    main()
