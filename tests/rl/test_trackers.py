"""Trackers: records written through each one read back from its own store (TensorBoard event
files parsed by TensorBoard's reader, the W&B offline run directory's transaction log, the MLflow
file store), in conformance probes and in a real run; credentials are references, never recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.rl.config import load_config
from miles_core.rl.trackers.builtin import BUILTIN_TRACKERS
from miles_core.testing.trackers import assert_tracker_conforms

register_cpu_ci(est_time=28, suite="stage-a-cpu")

SDK = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
SECRET = "sk-miles-test-0123456789abcdef"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.mark.parametrize("tracker", BUILTIN_TRACKERS, ids=lambda t: t.name)
def test_builtin_tracker_conforms(tracker) -> None:
    if SDK[tracker.name]:
        pytest.importorskip(SDK[tracker.name])
    stored = assert_tracker_conforms(tracker)
    assert stored[0]["reward_mean"] == 0.125 and stored[1]["loss"] == pytest.approx(-2.5e-3, rel=1e-6)
    assert "greedy_accuracy" not in stored[1]  # None is not a number: not written


def test_a_tracker_that_loses_records_fails_its_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the read-back check: a sink whose store drops a step is caught."""
    from miles_core.rl.trackers.builtin import JsonlTracker
    from miles_core.rl.trackers.jsonl import JsonlSink

    original = JsonlSink.log
    monkeypatch.setattr(JsonlSink, "log", lambda self, step, record: step == 0 and original(self, step, record))
    with pytest.raises(AssertionError, match=r"step 1 reward_mean = 0.75 was written, its store reads back None"):
        JsonlTracker().verify()


def test_tracker_options_are_validated_when_the_config_is_built(monkeypatch) -> None:
    base = ['run.trackers=["jsonl", "wandb", "mlflow"]']
    with pytest.raises(ConfigError, match=r"run.tracker_options.wandb.api_key: .*expected a secret reference"):
        load_config("tiny", overrides=[*base, f'run.tracker_options.wandb.api_key="{SECRET}"'])
    with pytest.raises(ConfigError, match=r"run.tracker_options.mlflow.colour: unknown option"):
        load_config("tiny", overrides=[*base, 'run.tracker_options.mlflow.colour="red"'])
    config = load_config("tiny", overrides=[*base, 'run.tracker_options.wandb.api_key="env:MY_WANDB_KEY"'])
    assert config.run.tracker_options["wandb"]["api_key"] == "env:MY_WANDB_KEY"


def test_a_run_writes_every_tracker_and_never_records_a_secret(
    miles_pm_factory, direct_overrides, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    for module in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(module)
    from miles_core.rl.loop import train
    from miles_core.rl.trackers.tensorboard_tracker import read_event_files
    from miles_core.rl.trackers.wandb_tracker import read_run_directory

    monkeypatch.setenv("MILES_TEST_WANDB_KEY", SECRET)
    monkeypatch.setenv("MILES_TEST_MLFLOW_TOKEN", SECRET)
    pm = miles_pm_factory(builtins=True)
    overrides = [direct_overrides, {"run": {
        "steps": 2, "checkpoint_every": 1,
        "trackers": ["jsonl", "tensorboard", "wandb", "mlflow"],
        "tracker_options": {"wandb": {"api_key": "env:MILES_TEST_WANDB_KEY", "project": "miles-test"},
                            "mlflow": {"tracking_token": "env:MILES_TEST_MLFLOW_TOKEN"}},
    }}]
    train(load_config(overrides=overrides, pm=pm), pm)
    # resumed: one more step, appended to the same tracker runs
    resumed = load_config(overrides=[*overrides, {"run": {"steps": 3}}], pm=pm)
    result = train(resumed, pm, resume=True)
    out = tmp_path / "run"
    records = {r["step"]: r for r in result.records}
    assert sorted(records) == [0, 1, 2]

    tensorboard = read_event_files(out / "tensorboard")
    wandb_runs = sorted((out / "wandb").glob("offline-run-*"))
    state = json.loads((out / "trackers.json").read_text())
    # resumed the same W&B run: every process's directory logs to run-<the recorded id>.wandb (the
    # directory's name is no guide: W&B appends -1 to a second one started within the same second)
    assert len(wandb_runs) == 2
    assert {log.name for d in wandb_runs for log in d.glob("run-*.wandb")} == {f"run-{state['wandb']['id']}.wandb"}
    history = {}
    for directory in wandb_runs:
        for step, values in read_run_directory(directory).items():
            history.setdefault(step, {}).update(values)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    mlflow_rewards = {m.step: m.value for m in client.get_metric_history(state["mlflow"]["run_id"], "reward_mean")}
    for step, record in records.items():
        assert tensorboard[step]["reward_mean"] == pytest.approx(record["reward_mean"], rel=1e-6)
        assert history[step]["reward_mean"] == pytest.approx(record["reward_mean"], rel=1e-12)
        assert mlflow_rewards[step] == pytest.approx(record["reward_mean"], rel=1e-12)
    params = client.get_run(state["mlflow"]["run_id"]).data.params
    assert params["run.tracker_options.mlflow.tracking_token"] == "env:MILES_TEST_MLFLOW_TOKEN"  # the reference

    captured = capfd.readouterr()
    assert SECRET not in captured.out + captured.err
    leaks = [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []


def test_the_wandb_log_reader_reads_a_log_while_it_is_written(tmp_path: Path) -> None:
    """close() reads W&B's transaction log while W&B's service may still be appending to it: every
    prefix of a real log (cut anywhere, records spanning 32 KiB blocks included) reads as a prefix
    of its records, never a cut record; a flipped byte in a complete record is reported as
    corruption, not parsed."""
    wandb = pytest.importorskip("wandb")
    from miles_core.rl.trackers.wandb_tracker import CorruptLogError, _log_records

    run = wandb.init(project="miles-test", dir=str(tmp_path), mode="offline",
                     settings=wandb.Settings(silent=True, console="off"))
    for step in range(40):  # ~3 KB a record: the log spans several blocks, some records split across them
        run.log({"step_value": step, "text": "x" * 3000}, step=step)
    run.finish()
    log = next(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    data = log.read_bytes()
    records = list(_log_records(log))
    assert len(data) > 3 * 32768 and len(records) > 40

    cut = tmp_path / "cut.wandb"
    for end in sorted({*range(0, len(data), 257), *range(32768 - 16, len(data), 32768), len(data) - 1}):
        cut.write_bytes(data[:end])
        read = list(_log_records(cut))
        assert read == records[: len(read)], f"cut at byte {end}"

    corrupt = bytearray(data)
    corrupt[7 + 7] ^= 0xFF  # the first record's first data byte (file header, then record header)
    cut.write_bytes(bytes(corrupt))
    with pytest.raises(CorruptLogError, match=r"cut.wandb: record at byte \d+ fails its checksum"):
        list(_log_records(cut))
