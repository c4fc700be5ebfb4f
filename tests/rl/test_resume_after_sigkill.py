"""Kill ``miles train`` with SIGKILL after a checkpoint, resume: the continuation equals an
uninterrupted run, and nothing recorded before the kill is lost."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.rl.metrics import deterministic_view

register_cpu_ci(est_time=32, suite="stage-b-cpu")

pytest.importorskip("miles_core.engine.engine", reason="the embedded engine (engine concern) is not installed")

STEPS = 6


def _config(path, model_dir, out_dir):
    path.write_text(f"""
[model]
path = "{model_dir}"
[task]
reward = "miles_core.rl.builtin:first_token_reward"
[rollout]
path = "direct"
prompts_per_step = 4
samples_per_prompt = 4
[trainer]
device = "cpu"
[run]
steps = {STEPS}
eval_every = 2
checkpoint_every = 2
out_dir = "{out_dir}"
""")
    return path


def _miles(*args, **kwargs):
    return [sys.executable, "-m", "miles_core", "train", "--no-progress", *args]


def _records(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_sigkill_after_checkpoint_then_resume_matches_uninterrupted(char_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full_cfg = _config(tmp_path / "full.toml", char_model_dir, tmp_path / "full")
    subprocess.run(_miles("--config", str(full_cfg)), check=True, env=env, capture_output=True)
    full = _records(tmp_path / "full")
    assert [r["step"] for r in full] == list(range(STEPS))

    killed_cfg = _config(tmp_path / "killed.toml", char_model_dir, tmp_path / "killed")
    proc = subprocess.Popen(_miles("--config", str(killed_cfg)), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "killed" / "checkpoints" / "step_000003" / "state.json"
    deadline = time.monotonic() + 240
    while not checkpoint.exists():
        assert proc.poll() is None, "the run ended before its second checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before_resume = _records(tmp_path / "killed")
    assert len(before_resume) >= 4  # steps 0-3 were recorded before the kill

    subprocess.run(_miles("--config", str(killed_cfg), "--resume"), check=True, env=env, capture_output=True)
    resumed = _records(tmp_path / "killed")
    assert [r["step"] for r in resumed] == list(range(STEPS))
    for got, want in zip(resumed[:4], before_resume[:4]):
        assert got == want  # recorded before the kill: kept byte for byte
    for got, want in zip(resumed, full):
        got, want = deterministic_view(got), deterministic_view(want)
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, float):
                assert abs(got[key] - value) <= 1e-7 + 1e-6 * abs(value), key
            else:
                assert got[key] == value, key
