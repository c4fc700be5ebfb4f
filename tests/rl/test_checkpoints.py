"""Checkpoints are safe to load, checked before anything is built, and never half-written.

Nothing is unpickled (a tampered file is refused, never run); a damaged newest checkpoint gives
way to the older intact one with a warning; a run without an intact one fails before its runtime
is built; a full disk fails in one line naming the directory and the bytes, leaving no staging
directory and the previous checkpoint intact; a moved run directory still resumes.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.rl.checkpoint import (
    CheckpointWarning,
    check_resumable,
    latest_valid,
    list_checkpoints,
    problem,
)
from miles_core.rl.config import TrainConfig, load_config
from miles_core.rl.loop import train
from miles_core.rl.tensor_tree import TreeError, load_tree, save_tree

register_cpu_ci(est_time=30, suite="stage-a-cpu")

pytest.importorskip("miles_core.engine.engine", reason="the embedded engine (engine concern) is not installed")


def test_a_tensor_tree_reads_back_equal_types_included(tmp_path: Path) -> None:
    tree = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}, "name.weight": {"v": torch.ones(4)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, "name.weight"], "foreach": None}],
        "python": (3, tuple(range(5)), None),
        "odd": [math.inf, -math.inf, True, "x"],
    }
    save_tree(tmp_path / "t", tree)
    back = load_tree(tmp_path / "t")
    assert back["python"] == tree["python"] and isinstance(back["python"][1], tuple)
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert list(back["state"]) == [0, "name.weight"]
    assert torch.equal(back["state"][0]["exp_avg"], tree["state"][0]["exp_avg"])
    assert back["odd"] == tree["odd"]


def test_a_pickle_in_place_of_a_tree_is_refused_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    save_tree(tmp_path / "t", {"a": torch.zeros(1)})
    (tmp_path / "t.json").write_bytes(pickle.dumps(Exploit()))
    (tmp_path / "t.safetensors").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(TreeError, match=r"t\.json: not readable as JSON"):
        load_tree(tmp_path / "t")
    save_tree(tmp_path / "u", {"a": torch.zeros(1)})
    (tmp_path / "u.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(TreeError, match=r"u\.safetensors: not a readable safetensors file"):
        load_tree(tmp_path / "u")
    assert not marker.exists()


@pytest.fixture
def checkpointed(miles_pm_factory, direct_overrides, tmp_path):
    """A 3-step run with a checkpoint after steps 1 and 2 (files hashed in state.json)."""
    pm = miles_pm_factory(builtins=True)
    config = load_config(overrides=[direct_overrides, {"run": {"checkpoint_every": 1, "keep_checkpoints": 3}}])
    train(config, pm)
    return pm, config, tmp_path / "run"


def test_a_checkpoint_holds_no_pickle_and_records_every_file(checkpointed) -> None:
    _, _, run = checkpointed
    newest = list_checkpoints(run)[-1]
    names = {p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file()}
    assert not any(name.endswith((".pt", ".pkl", ".bin")) for name in names), names
    assert {"rng.json", "rng.safetensors", "optimizer.json", "optimizer.safetensors"} <= names
    manifest = json.loads((newest / "state.json").read_text())["files"]
    assert set(manifest) == names - {"state.json"}
    assert problem(newest) is None
    assert not list((run / "checkpoints").glob(".staging_*"))


@pytest.mark.parametrize("damage", ["truncate-model", "garbage-optimizer", "garbage-rng"])
def test_a_damaged_newest_checkpoint_gives_way_to_the_older_one(checkpointed, damage) -> None:
    pm, config, run = checkpointed
    older, newest = list_checkpoints(run)[-2:]
    if damage == "truncate-model":
        model = newest / "model" / "model.safetensors"
        model.write_bytes(model.read_bytes()[:100])
    elif damage == "garbage-optimizer":
        (newest / "optimizer.safetensors").write_bytes(b"garbage")
    else:
        (newest / "rng.json").write_text('{"format": "miles-tensor-tree/1", "tree": 5}')
    assert problem(newest) is not None and problem(older) is None
    with pytest.warns(CheckpointWarning, match=rf"skipped damaged checkpoint\(s\) {newest.name}"):
        assert latest_valid(run) == older
    longer = config.model_copy(update={"run": config.run.model_copy(update={"steps": 4})})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        resumed = train(longer, pm, resume=True)
    assert [r["step"] for r in resumed.records] == [0, 1, 2, 3]


def test_no_intact_checkpoint_fails_before_the_runtime_is_built(checkpointed) -> None:
    pm, config, run = checkpointed
    for checkpoint in list_checkpoints(run):
        (checkpoint / "optimizer.safetensors").write_bytes(b"garbage")
    built = []
    with pytest.raises(ConfigError, match=r"no intact checkpoint .*optimizer\.safetensors has 7 bytes"):
        train(config, pm, resume=True, build=lambda *a: built.append(a))
    assert built == []


def test_a_pickled_checkpoint_of_an_older_miles_is_refused_by_name(checkpointed) -> None:
    pm, config, run = checkpointed
    for checkpoint in list_checkpoints(run):
        torch.save({"python": 1}, checkpoint / "rng.pt")
    with pytest.raises(ConfigError, match=r"written by an older miles \(rng\.pt\)"):
        train(config, pm, resume=True, build=lambda *a: pytest.fail("built"))


def test_a_moved_run_directory_resumes(checkpointed, tmp_path) -> None:
    pm, config, run = checkpointed
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    shutil.move(run, moved)
    config = config.model_copy(update={"run": config.run.model_copy(update={"out_dir": str(moved), "steps": 4})})
    resumed = train(config, pm, resume=True)
    assert [r["step"] for r in resumed.records] == [0, 1, 2, 3]


FULL_DISK = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from miles_core.rl.checkpoint import LoopState, save_checkpoint
from miles_core.errors import MilesError

class Trainer:  # writes as much as a real trainer would, through safetensors
    def __init__(self, numel): self.numel = numel
    def save(self, directory):
        (directory / "model").mkdir()
        save_file({"w": torch.zeros(self.numel)}, str(directory / "model" / "model.safetensors"))

run = Path(sys.argv[1])
out = {}
for step, numel in ((0, 8_000), (1, 200_000), (2, 8_000)):
    try:
        save_checkpoint(run, Trainer(numel), LoopState(step, {}, "v", {}), keep=5)
        out[step] = "ok"
    except MilesError as exc:
        out[step] = str(exc)
out["left"] = sorted(p.name for p in (run / "checkpoints").iterdir())
print(json.dumps(out))
"""


def test_a_full_disk_fails_in_one_line_and_leaves_nothing_half_written(tmp_path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare is not installed")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(textwrap.dedent(FULL_DISK))
    # a 400 KiB filesystem of our own, in a mount namespace (root or an unprivileged user namespace)
    shell = f"mount -t tmpfs -o size=400k none {disk} && exec {sys.executable} {script} {disk}/run"
    proc = subprocess.run(["unshare", "--map-root-user", "--mount", "sh", "-c", shell],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "mount" in proc.stderr and not proc.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["0"] == "ok"
    full = out["1"]
    assert "\n" not in full and "the disk is full" in full and "step_000001" in full
    assert "needs more than the" in full and "bytes that were free" in full and "previous checkpoint is intact" in full
    assert out["2"] == "ok"  # the next, smaller checkpoint still fits: nothing was left behind
    assert out["left"] == ["step_000000", "step_000002"]


def test_a_setting_newer_than_the_checkpoint_resumes_only_at_its_default() -> None:
    defaults = TrainConfig().to_dict()
    current = load_config("tiny").to_dict()
    older = json.loads(json.dumps(current))
    del older["rollout"]["gdn_state_dtype"]  # written before the setting existed
    check_resumable(older, current, defaults)
    current["rollout"]["gdn_state_dtype"] = "bfloat16"
    with pytest.raises(ConfigError, match=r"rollout\.gdn_state_dtype: checkpoint has None, now 'bfloat16'"):
        check_resumable(older, current, defaults)
