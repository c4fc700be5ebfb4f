"""`miles train --preset tiny` end to end: agentic rollouts through the session server, answers
checked in the local sandbox, GDN packing verified; refused without the packing patch."""

import json
import os
import subprocess
import sys

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=58, suite="stage-b-cpu")

pytest.importorskip("miles_core.session.embed")
pytest.importorskip("miles_core.engine.server")


def _train(*args, env=None):
    return subprocess.run([sys.executable, "-m", "miles_core", "train", "--preset", "tiny", *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)


def test_tiny_preset_learns_through_session_server_and_sandbox(tmp_path):
    """The README's main-job command, unchanged: from <= 0.2 to >= 0.9 greedy accuracy within its
    own time limit, every step's rollouts through the session server and rewards in the sandbox."""
    out = tmp_path / "run"
    proc = _train("--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # exactly one JSON document on stdout
    assert summary["initial_accuracy"] <= 0.2 and summary["final_accuracy"] >= 0.9 and summary["stopped_early"]
    assert summary["max_logprob_mismatch"] <= 1e-4  # packed GDN rows, fp32, patch applied
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(summary["steps"]))
    for record in records:
        assert record["time_rollout_session_v1"] > 0 and record["time_reward_sandbox_local"] > 0
        assert record["train_tokens"] > 0
    assert summary["report"]["packing_leak"] is not None and summary["report"]["packing_leak"] <= 1e-4
    assert (out / "plot.png").exists()
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] == summary["final_accuracy"]
    # the policy that reached the target is kept
    assert (out / "checkpoints" / f"step_{summary['steps'] - 1:06d}").is_dir()


def test_tiny_preset_refuses_without_the_packing_patch(tmp_path):
    proc = _train("--steps", "1", "--out", str(tmp_path / "run"), env={"MILES_DISABLE_PLUGINS": "miles-qwen35"})
    assert proc.returncode == 1
    assert "refusing to train" in proc.stderr and "miles[qwen35]" in proc.stderr
    assert "MILES_DISABLE_PLUGINS" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("algorithm", ["dr-grpo", "gspo"])
def test_every_builtin_algorithm_learns_the_tiny_preset(algorithm, tmp_path):
    """`miles train --preset tiny --set algorithm.name=<it>` reaches 0.9 within the preset's own
    step and time limits (GRPO is the preset's default, tested above)."""
    proc = _train("--out", str(tmp_path / "run"), "--json", "--set", f"algorithm.name={algorithm}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["report"]["algorithm"] == algorithm
    assert summary["initial_accuracy"] <= 0.2 and summary["final_accuracy"] >= 0.9 and summary["stopped_early"]
