"""TRL's GRPOTrainer vs miles on the same task, model, machine and settings.

Task: the 55 prompts "a+b=" (single digits, a + b <= 9); reward 1 when the first generated token
is the digit of the sum. Model: the same random-init 2-layer, hidden-64 Llama-architecture causal
LM for both (same seed -> same weights), a character-level tokenizer, fp32, one torch thread.

Identical settings on both sides (:data:`SETTINGS`): every step samples all 55 prompts x 8
completions (440 per step, one token each), temperature 1, group-normalised advantages (divided by
the group's std), one optimizer step per rollout batch (AdamW, constant learning rate 3e-3, no
weight decay, gradient norm clipped at 1), the PPO clip at 0.2, a k3 KL penalty of 0.3 to the
initial policy weighted by each token's importance ratio (TRL's default ``use_bias_correction_kl``,
miles' ``kl_bias_correction``: the unbiased reverse-KL gradient), no gradient checkpointing. With
one-token completions every token-normalisation
TRL offers equals miles' token mean. The stopping rule is the same too: after every step, greedy
accuracy on all 55 prompts; the run stops at 0.9, or after ``--max-steps`` steps (never reached).

Measured per seed: training time to 0.9 (the clock pauses while evaluating, on both sides),
steps to 0.9 and ms per step. Seeds alternate (TRL seed s, then miles seed s, ...), each run in a
fresh subprocess, so machine load falls on both alike. Prints two JSON lines:

* ``rl_vs_trl``: identical settings; ``ratio_time`` = miles' median time to 0.9 over TRL's, and
  ``ratio_ms_per_step`` likewise (targets <= 0.5 each).
* ``rl_vs_trl_defaults``: for reference, TRL with its own GRPO defaults (learning rate 1e-6, no KL,
  8 completions per step, linear decay, gradient checkpointing), only the task-specific settings
  changed, against the same miles runs.

    python benchmarks/rl_vs_trl.py [--seeds 0 1 2 3 4] [--max-steps 150] [--no-defaults]

Needs ``pip install -e ".[bench]"`` (trl 1.16).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_core.assets.char_model import write_char_model

TARGET = 0.9
PROMPTS_PER_STEP = 55  # every prompt every step
SETTINGS: dict[str, Any] = {
    "samples_per_prompt": 8,
    "max_new_tokens": 1,  # the reward reads only the first generated token
    "temperature": 1.0,
    "lr": 3e-3,
    "kl_coef": 0.3,
    "kl_bias_correction": True,
    "clip": 0.2,
    "max_grad_norm": 1.0,
}


def prompts() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10) if a + b <= 9]


# -- TRL ------------------------------------------------------------------------------------


def trl_args(variant: str, seed: int, max_steps: int) -> dict[str, Any]:
    common = {
        "output_dir": tempfile.mkdtemp(prefix="trl-bench-"), "max_steps": max_steps, "seed": seed, "data_seed": seed,
        "max_completion_length": SETTINGS["max_new_tokens"], "logging_steps": 10**9, "save_strategy": "no",
        "report_to": "none", "use_cpu": True, "bf16": False, "disable_tqdm": True,
    }
    if variant == "defaults":
        return common
    return {
        **common,
        "per_device_train_batch_size": PROMPTS_PER_STEP * SETTINGS["samples_per_prompt"],
        "num_generations": SETTINGS["samples_per_prompt"],
        "temperature": SETTINGS["temperature"],
        "learning_rate": SETTINGS["lr"],
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "beta": SETTINGS["kl_coef"],
        "use_bias_correction_kl": SETTINGS["kl_bias_correction"],
        "epsilon": SETTINGS["clip"],
        "max_grad_norm": SETTINGS["max_grad_norm"],
        "scale_rewards": "group",
        "num_iterations": 1,
        "gradient_checkpointing": False,
    }


def run_trl(model_dir: Path, seed: int, max_steps: int, variant: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    items = prompts()
    answers = dict(items)

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:  # TRL's RewardFunc
        return [1.0 if c[:1] == answers[p] else 0.0 for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def greedy_accuracy() -> float:
        was_training = model.training
        model.eval()
        enc = tokenizer([p for p, _ in items], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=0)
        first = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:])
        model.train(was_training)
        return sum(f[:1] == a for f, (_, a) in zip(first, items)) / len(items)

    class Clock(TrainerCallback):
        """Times training steps only: evaluation after each step pauses the clock."""

        def __init__(self) -> None:
            self.started = self.paused = 0.0
            self.steps = 0
            self.reached: float | None = None
            self.accuracy = 0.0

        def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                           **kw: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                        **kw: Any) -> None:
            self.steps += 1
            pause = time.perf_counter()
            self.accuracy = greedy_accuracy()
            self.paused += time.perf_counter() - pause
            if self.accuracy >= TARGET:
                self.reached = time.perf_counter() - self.started - self.paused
                control.should_training_stop = True

    clock = Clock()
    args = GRPOConfig(**trl_args(variant, seed, max_steps))
    dataset = Dataset.from_dict({"prompt": [p for p, _ in items]})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    elapsed = time.perf_counter() - clock.started - clock.paused
    return {"seconds_to_target": clock.reached, "steps": clock.steps, "reached": clock.reached is not None,
            "final_accuracy": clock.accuracy, "ms_per_step": 1000 * elapsed / max(clock.steps, 1)}


# -- miles ----------------------------------------------------------------------------------


def miles_overrides(model_dir: Path, seed: int, max_steps: int, out_dir: Path) -> dict[str, Any]:
    return {
        "model": {"path": str(model_dir), "preset": None, "dtype": "float32"},
        "task": {"name": "arith-add", "reward": "miles_core.rl.builtin:first_token_reward"},
        "rollout": {"path": "direct", "prompts_per_step": PROMPTS_PER_STEP,
                    "samples_per_prompt": SETTINGS["samples_per_prompt"],
                    "max_new_tokens": SETTINGS["max_new_tokens"], "temperature": SETTINGS["temperature"]},
        "algorithm": {"lr": SETTINGS["lr"], "weight_decay": 0.0, "kl_coef": SETTINGS["kl_coef"],
                      "kl_bias_correction": SETTINGS["kl_bias_correction"],
                      "clip_low": SETTINGS["clip"], "clip_high": SETTINGS["clip"], "scale_by_std": True,
                      "epochs": 1, "minibatches": 1, "max_grad_norm": SETTINGS["max_grad_norm"]},
        "trainer": {"device": "cpu", "gradient_checkpointing": False},
        "run": {"seed": seed, "out_dir": str(out_dir), "steps": max_steps, "eval_every": 1,
                "stop_at_accuracy": TARGET, "progress": False, "plot": False, "torch_threads": 1},
    }


def _number(record: Mapping[str, object], key: str, default: float | None = None) -> float:
    """``record[key]`` (``default`` when given and the key is absent) as a number: a metrics record's
    values are of several types."""
    value = record[key] if default is None else record.get(key, default)
    if not isinstance(value, float | int):
        raise TypeError(f"metrics record: {key!r} is {value!r}, not a number")
    return value


def run_miles(model_dir: Path, seed: int, max_steps: int, out_dir: Path) -> dict:
    import torch

    torch.set_num_threads(1)
    from miles_core.plugins import get_plugin_manager
    from miles_core.rl.config import load_config
    from miles_core.rl.loop import train

    config = load_config(overrides=[miles_overrides(model_dir, seed, max_steps, out_dir)])
    result = train(config, get_plugin_manager())
    records = result.records
    training = sum(_number(r, "time_step") - _number(r, "time_eval", 0.0) for r in records)
    steps = len(records)
    # evaluated before each step, and once after the last one (as TRL evaluates after each step)
    reached = result.stopped_early or (result.final_accuracy or 0.0) >= TARGET
    return {
        "seconds_to_target": training if reached else None,
        "steps": steps,
        "reached": reached,
        "final_accuracy": result.final_accuracy,
        "ms_per_step": 1000 * training / max(steps, 1),
        "max_logprob_mismatch": max((_number(r, "logprob_mismatch_max") for r in records), default=None),
    }


# -- driver ---------------------------------------------------------------------------------


def worker(framework: str, seed: int, max_steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="rl-vs-trl-") as tmp:
        model_dir = write_char_model(Path(tmp) / "model", seed)
        if framework == "miles":
            return run_miles(model_dir, seed, max_steps, Path(tmp) / "run")
        return run_trl(model_dir, seed, max_steps, "defaults" if framework == "trl-defaults" else "identical")


def summarize(runs: list[dict]) -> dict:
    reached = [r["seconds_to_target"] for r in runs if r["reached"]]
    return {
        "median_s_to_target": statistics.median(reached) if reached else None,
        "median_steps_to_target": statistics.median([r["steps"] for r in runs if r["reached"]]) if reached else None,
        "median_ms_per_step": statistics.median([r["ms_per_step"] for r in runs]),
        "never_reached": len(runs) - len(reached),
        "runs": runs,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def spawn(framework: str, seed: int, max_steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, __file__, "--worker", framework, "--seed", str(seed), "--max-steps", str(max_steps)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{framework} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = {"seed": seed, **json.loads(line.removeprefix("RESULT "))}
    print(f"{framework} seed {seed}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--max-steps", type=int, default=150, help="step cap per run (never reached past it)")
    parser.add_argument("--no-defaults", action="store_true", help="skip the TRL-defaults reference runs")
    parser.add_argument("--worker", choices=["trl", "trl-defaults", "miles"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        sys.exit("rl_vs_trl.py needs trl 1.16, the bench extra: pip install -e '.[bench]'")
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.seed, args.max_steps)), flush=True)
        return
    frameworks = ["trl", "miles"] + ([] if args.no_defaults else ["trl-defaults"])
    results: dict[str, list[dict]] = {name: [] for name in frameworks}
    for seed in args.seeds:  # alternated: machine load falls on every framework alike
        for framework in frameworks:
            results[framework].append(spawn(framework, seed, args.max_steps))
    load = os.getloadavg()[0]
    summary = {name: summarize(runs) for name, runs in results.items()}
    miles = summary["miles"]
    for name, label in (("trl", "rl_vs_trl"), ("trl-defaults", "rl_vs_trl_defaults")):
        if name not in summary:
            continue
        trl = summary[name]
        time_ratio = ratio(miles["median_s_to_target"], trl["median_s_to_target"])
        step_ratio = ratio(miles["median_ms_per_step"], trl["median_ms_per_step"])
        line: dict[str, Any] = {
            "benchmark": label, "target_accuracy": TARGET, "seeds": args.seeds, "max_steps": args.max_steps,
            "settings": SETTINGS if name == "trl" else "TRL GRPOConfig defaults (task-specific fields only)",
            "ratio_time": time_ratio, "ratio_ms_per_step": step_ratio, "load_avg_1m_end": round(load, 2),
            "trl": trl, "miles": miles,
        }
        if name == "trl":
            line["targets"] = {"ratio_time": 0.5, "ratio_ms_per_step": 0.5}
            line["meets_targets"] = (time_ratio is not None and time_ratio <= 0.5 and step_ratio is not None
                                     and step_ratio <= 0.5 and miles["never_reached"] == 0)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
