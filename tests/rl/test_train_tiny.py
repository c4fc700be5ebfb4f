"""`miles train --preset tiny` end to end: agentic rollouts through the session server, answers
checked in the local sandbox, GDN packing verified; refused without the packing patch."""

import json
import os
import subprocess
import sys

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=40, suite="stage-b-cpu")

pytest.importorskip("miles_core.session.embed")
pytest.importorskip("miles_core.engine.server")


def _train(*args, env=None):
    return subprocess.run([sys.executable, "-m", "miles_core", "train", "--preset", "tiny", *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)


def test_tiny_preset_runs_through_session_server_and_sandbox(tmp_path):
    proc = _train("--steps", "3", "--out", str(tmp_path / "run"), "--set", "run.eval_every=2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # exactly one JSON document on stdout
    assert summary["steps"] == 3 and summary["initial_accuracy"] <= 0.2
    assert summary["max_logprob_mismatch"] <= 1e-4  # packed GDN rows, fp32, patch applied
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        assert record["time_rollout_session_v1"] > 0 and record["time_reward_sandbox_local"] > 0
        assert record["train_tokens"] > 0
    assert summary["report"]["packing_leak"] is not None and summary["report"]["packing_leak"] <= 1e-4
    assert (tmp_path / "run" / "plot.png").exists()


def test_tiny_preset_refuses_without_the_packing_patch(tmp_path):
    proc = _train("--steps", "1", "--out", str(tmp_path / "run"), env={"MILES_DISABLE_PLUGINS": "miles-qwen35"})
    assert proc.returncode == 1
    assert "refusing to train" in proc.stderr and "miles[qwen35]" in proc.stderr
    assert "MILES_DISABLE_PLUGINS" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
