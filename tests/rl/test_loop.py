import json
import os
import signal

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.rl.config import load_config
from miles_core.rl.loop import PromptSampler, train
from miles_core.rl.metrics import deterministic_view
from miles_core.rl.tasks import Prompt

register_cpu_ci(est_time=35, suite="stage-a-cpu")

pytest.importorskip("miles_core.engine.engine", reason="the embedded engine (engine concern) is not installed")

REQUIRED = {
    "step", "reward_mean", "greedy_accuracy", "response_length_mean", "logprob_mismatch_max", "approx_kl",
    "entropy", "grad_norm", "time_train", "time_sync", "time_rollout_direct", "time_reward_inprocess",
    "tokens_per_s", "rollout_tokens_per_s", "train_tokens_per_s", "weight_version", "rollout_weight_versions",
}


def test_direct_run_records_checkpoints_and_plots(miles_pm_factory, direct_overrides, tmp_path):
    config = load_config(overrides=[direct_overrides, {"run": {"checkpoint_every": 2}}])
    result = train(config, miles_pm_factory(builtins=True))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] == [r["step"] for r in result.records]
    for r in records:
        assert r.keys() >= REQUIRED, REQUIRED - r.keys()
        assert r["logprob_mismatch_max"] <= 1e-4  # fp32: trainer and engine agree on sampled tokens
        assert 0 <= r["reward_mean"] <= 1 and r["greedy_accuracy"] is not None
    # on-policy: each step's rollouts come from the weights the previous step synced
    assert [r["rollout_weight_versions"] for r in records] == [["0"], ["step-1"], ["step-2"]]
    assert [r["weight_version"] for r in records] == ["step-1", "step-2", "step-3"]
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step_000001", "step_000002"]
    last = tmp_path / "run" / "checkpoints" / "step_000002"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (last / "model").iterdir()}
    assert json.loads((last / "state.json").read_text())["cursor"] == {"epoch": 0, "offset": 12}
    assert (tmp_path / "run" / "plot.png").stat().st_size > 10_000
    assert result.summary()["final_accuracy"] is not None
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # start-up (imports, parts verified, runtime built) as a share of the run: one first step's elapsed
    assert 0 < summary["startup_s"] < records[0]["elapsed_s"] <= summary["seconds"]
    # the share is taken before startup_s and seconds are rounded to 0.01 s (each off by <= 0.005 s)
    # and is itself rounded to 0.001: that bounds how far the rounded values can disagree
    share = summary["startup_s"] / summary["seconds"]
    assert summary["startup_share"] == pytest.approx(share, abs=0.005 * (1 + share) / summary["seconds"] + 5e-4)
    hardware = json.loads((tmp_path / "run" / "summary.json").read_text())["hardware"]  # the backend that ran
    assert (hardware["plugin"], hardware["builtin"], hardware["replaces"]) == ("core-hardware", True, [])


def test_resume_continues_exactly(miles_pm_factory, direct_overrides, tmp_path):
    pm = miles_pm_factory(builtins=True)
    full = train(load_config(overrides=[direct_overrides, {"run": {"steps": 4, "out_dir": str(tmp_path / "a")}}]), pm)
    part = load_config(overrides=[direct_overrides, {"run": {"steps": 4, "checkpoint_every": 2, "out_dir": str(tmp_path / "b")}}])
    train(part.model_copy(update={"run": part.run.model_copy(update={"steps": 3})}), pm)
    # steps 0-2 ran; the checkpoint is after step 1, so step 2 is recomputed on resume
    resumed = train(part, pm, resume=True)
    assert len(resumed.records) == len(full.records) == 4
    for got, want in zip(resumed.records, full.records):
        assert_same_metrics(deterministic_view(got), deterministic_view(want))


def assert_same_metrics(got, want):
    """Tokens, rewards, versions exact; floats to 1e-6 (the engine's batched kernels may round
    the last bits of a log-prob differently depending on its cache history)."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
        else:
            assert got[key] == value, key


def test_refuses_to_overwrite_or_resume_under_other_settings(miles_pm_factory, direct_overrides, tmp_path):
    pm = miles_pm_factory(builtins=True)
    config = load_config(overrides=[direct_overrides, {"run": {"steps": 1}}])
    train(config, pm)
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="already holds a run"):
        train(config, pm)
    other = load_config(overrides=[direct_overrides, {"run": {"steps": 2}, "algorithm": {"lr": 0.5}}])
    with pytest.raises(ConfigError, match=r"algorithm\.lr: checkpoint has 0\.001, now 0\.5"):
        train(other, pm, resume=True)
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before


def test_prompt_sampler_epochs_and_cursor():
    prompts = [Prompt(id=str(i), text=str(i), answer="") for i in range(5)]
    sampler = PromptSampler(prompts, per_step=3, seed=1)
    first = [p.id for p in sampler.next() + sampler.next()]
    assert sorted(first[:5]) == ["0", "1", "2", "3", "4"]  # an epoch is a permutation
    cursor = sampler.cursor
    after = [p.id for p in sampler.next()]
    again = PromptSampler(prompts, per_step=3, seed=1)
    again.restore(cursor)
    assert [p.id for p in again.next()] == after


def _run_dirs(runs):
    return sorted(p.name for p in runs.iterdir() if p.is_dir() and not p.is_symlink())


def test_runs_without_out_dir_get_a_directory_each_and_latest_is_resumed(miles_pm_factory, direct_overrides, tmp_path):
    pm = miles_pm_factory(builtins=True)
    runs = tmp_path / "runs"
    config = load_config(overrides=[direct_overrides, {"run": {"steps": 2, "out_dir": None, "runs_dir": str(runs)}}])
    first, second = train(config, pm), train(config, pm)  # the same command twice: both run
    assert first.out_dir.parent == second.out_dir.parent == runs and first.out_dir != second.out_dir
    assert _run_dirs(runs) == sorted([first.out_dir.name, second.out_dir.name])
    assert (runs / "latest").resolve() == second.out_dir.resolve()
    assert json.loads((second.out_dir / "summary.json").read_text())["out_dir"] == str(second.out_dir)

    longer = config.model_copy(update={"run": config.run.model_copy(update={"steps": 3})})
    resumed = train(longer, pm, resume=True)  # continues latest, in its directory
    assert resumed.out_dir == second.out_dir and [r["step"] for r in resumed.records] == [0, 1, 2]
    assert len(first.records) == 2 and _run_dirs(runs) == sorted([first.out_dir.name, second.out_dir.name])

    def failing_build(*args):
        raise RuntimeError("the engine did not start")

    before = (_run_dirs(runs), (runs / "latest").readlink())
    with pytest.raises(RuntimeError, match="did not start"):
        train(config, pm, build=failing_build)
    assert (_run_dirs(runs), (runs / "latest").readlink()) == before  # a failed start leaves nothing


@pytest.mark.skipif(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, reason="SIGINT is ignored in this process")
def test_a_ctrl_c_while_the_runtime_closes_waits_for_the_close(miles_pm_factory, direct_overrides, tmp_path):
    """Ctrl-C during the close at the end of a run: every closer still runs (the background
    event loop ends closed), then the KeyboardInterrupt comes. Raised inside the first closer,
    it would skip the rest."""
    from miles_core.rl.runtime import build_inprocess

    config = load_config(overrides=[direct_overrides, {"run": {"steps": 1, "eval_every": 0}}])
    closed: list[str] = []
    runtimes = []

    def build(*args):
        runtime = build_inprocess(*args)
        for index, close in enumerate(runtime.closers):
            def recorded(close=close, index=index):
                close()
                closed.append(str(index))
            runtime.closers[index] = recorded
        runtime.closers.append(lambda: (os.kill(os.getpid(), signal.SIGINT), closed.append("ctrl-c")))
        runtimes.append(runtime)
        return runtime

    with pytest.raises(KeyboardInterrupt):
        train(config, miles_pm_factory(builtins=True), build=build)
    count = len(runtimes[0].closers) - 1
    assert closed == ["ctrl-c", *(str(i) for i in reversed(range(count)))]
    assert runtimes[0].aio.loop.is_closed()


def test_run_directory_rules(tmp_path):
    from miles_core.rl.preflight import choose_run_dir

    runs = tmp_path / "runs"
    config = load_config("tiny", overrides=[{"run": {"runs_dir": str(runs)}}])
    planned = choose_run_dir(config, resume=True, now=0)  # nothing to resume: a new run
    assert planned.new and planned.path.parent == runs and not runs.exists()
    runs.mkdir()
    (runs / "metrics.jsonl").write_text("{}\n")  # a run written straight into runs_dir (--out runs/tiny)
    with pytest.raises(ConfigError, match=rf"--resume: {runs} has no latest run .* --out {runs} --resume"):
        choose_run_dir(config, resume=True)
    (runs / "latest").mkdir()
    with pytest.raises(ConfigError, match="latest is not a link"):
        choose_run_dir(config, resume=False)


def test_the_engine_stores_gdn_states_as_the_rollout_section_says(miles_pm_factory, direct_overrides, monkeypatch):
    from miles_core.engine.engine import Engine

    built = []
    real = Engine.from_pretrained

    def recording(cls, *args, **kwargs):
        engine = real(*args, **kwargs)
        built.append(engine.runner_info()["gdn_state_dtype"])
        return engine

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(recording))
    config = load_config(overrides=[direct_overrides, {"run": {"steps": 1}, "rollout": {"gdn_state_dtype": "bfloat16"}}])
    train(config, miles_pm_factory(builtins=True))
    assert built == ["bfloat16"]
