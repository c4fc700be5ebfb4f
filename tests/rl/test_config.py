import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError
from miles_core.rl.config import PRESETS, TrainConfig, describe_settings, load_config, parse_override

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def test_presets_validate():
    for name in PRESETS:
        assert isinstance(load_config(name), TrainConfig)
    tiny = load_config("tiny")
    assert tiny.rollout.path == "agentic" and tiny.model.preset == "tiny-rl" and tiny.run.time_limit_s == 150
    assert load_config("small-gpu").model.dtype == "bfloat16"


def test_layers_apply_in_order(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[rollout]\ntemperature = 0.5\nmax_new_tokens = 3\n[run]\nseed = 7\n')
    cfg = load_config("tiny", toml, ["rollout.max_new_tokens=5", {"run": {"steps": 3}}])
    assert (cfg.rollout.temperature, cfg.rollout.max_new_tokens, cfg.run.seed, cfg.run.steps) == (0.5, 5, 7, 3)
    assert cfg.rollout.path == "agentic"  # untouched preset value survives


def test_model_path_replaces_preset_model():
    cfg = load_config("tiny", overrides=['model.path="/models/x"'])
    assert cfg.model.path == "/models/x" and cfg.model.preset is None


def test_a_model_setting_alone_keeps_the_default_model(tmp_path):
    assert TrainConfig().model.preset == "tiny"
    assert load_config(overrides=["model.dtype=bfloat16"]).model.model_dump() == {
        "preset": "tiny", "path": None, "dtype": "bfloat16"}
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\ndtype = "bfloat16"\n')
    assert load_config(file=toml).model.preset == "tiny"
    # one layer naming both sources is still refused, by name
    with pytest.raises(ConfigError, match=r"exactly one of model\.preset and model\.path"):
        load_config(overrides=[{"model": {"preset": "tiny", "path": "/models/x"}}])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rollout.bogus=1", "rollout.bogus: unknown setting in rollout"),
        ("nonsense.key=1", "nonsense: unknown section"),
        ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt must be >= 2"),
        ("run.steps=0", "run.steps: Input should be greater than or equal to 1"),
        ("rollout.max_turns=3", "rollout.max_turns > 1 needs rollout.path = 'agentic'"),
        ("trainer.mtp_num_layers=1", "trainer.mtp_num_layers needs trainer.backend = 'megatron'"),
        ('orchestrator.address="ray://h:10001"', "orchestrator.address is set"),
        ('trainer.backend="jax"', "trainer.backend: unknown trainer backend 'jax' (installed: hf, megatron)"),
        ('algorithm.name="gpro"', "algorithm.name: unknown algorithm 'gpro' (installed: dr-grpo, grpo, gspo); did you mean 'grpo'?"),
        ('rollout.path="agentic-x"', "did you mean 'agentic'?"),
        ('orchestrator.kind="rey"', "orchestrator.kind: unknown orchestrator 'rey' (installed: inprocess, ray); did you mean 'ray'?"),
        ('run.trackers=["jsonl", "tensorbord"]', "run.trackers: unknown tracker 'tensorbord'"),
        ('run.trackers=["tensorboard"]', "run.trackers must include 'jsonl'"),
        ('rollout.gdn_state_dtype="float16"', "rollout.gdn_state_dtype: Input should be 'float32' or 'bfloat16'"),
        ("rollout.concurrency=3", "rollout.concurrency is set: needs rollout.path = 'agentic' (rollout.path 'direct' does not use it)"),
        ("trainer.mtp_loss_coef=0.5", "trainer.mtp_loss_coef = 0.5 needs trainer.backend = 'megatron' (trainer.backend 'hf' does not use it)"),
        ("orchestrator.rollout_workers=2", "orchestrator.rollout_workers > 1 needs orchestrator.kind = 'ray'"),
        ('run.tracker_options.wandb.mode="offline"', "run.tracker_options.wandb is set but run.trackers does not include 'wandb'"),
        ("algorithm.minibatches=1000", "algorithm.minibatches (1000) exceeds the samples per step"),
        ("trainer.lr=0.1", "trainer.lr: unknown setting in trainer; did you mean algorithm.lr?"),
        ('out_dir="x"', "out_dir: unknown setting; did you mean run.out_dir?"),
        ("rollout.sample_per_prompt=3", "rollout.sample_per_prompt: unknown setting in rollout; did you mean rollout.samples_per_prompt?"),
        ("algorithm.device=1", "did you mean trainer.device?"),
        ("traner.lr=1", "traner: unknown section; did you mean algorithm.lr?"),
        ("traner.nothing=1", "traner: unknown section; did you mean trainer?"),
        ('task.name="nope"', "task.name: unknown task 'nope' (installed: arith-add, arith-next)"),
        ('task.name="arith-nxt"', "did you mean 'arith-next'?"),
        ('model.preset="small"', "model.preset: unknown engine preset 'small'"),
        ('trainer.device="tpu"', "trainer.device: 'tpu' is neither auto nor TYPE[:INDEX] with a device type of the installed hardware backends (installed: cpu, cuda)"),
        ('trainer.device="cuda:x"', "trainer.device: 'cuda:x' is neither"),
    ],
)
def test_bad_settings_name_the_setting(override, needle):
    base = ['rollout.path="direct"'] if "max_turns" in override or "concurrency" in override else []
    with pytest.raises(ConfigError) as info:
        load_config("tiny", overrides=[*base, override])
    assert needle in str(info.value)


def test_bad_files_and_presets(tmp_path):
    with pytest.raises(ConfigError, match="preset: unknown preset 'huge'"):
        load_config("huge")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(file=tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    with pytest.raises(ConfigError, match=r"bad.toml: .*line 1"):
        load_config(file=bad)
    with pytest.raises(ConfigError, match=r"expected SECTION\.KEY=VALUE"):
        parse_override("no-equals-sign")


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_device_forms_of_the_installed_backends_pass(device):
    assert load_config("tiny", overrides=[f'trainer.device="{device}"']).trainer.device == device


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("run.yaml", "run:\n  steps: 3\n", "this file is named as YAML"),
        ("run.yml", "[run]\nsteps = 3\n", "this file is named as YAML"),
        ("run.json", '{"run": {"steps": 3}}', "this file is named as JSON"),
        ("run.toml", "run:\n  steps: 3\n  seed: 1\n", "this file looks like YAML"),
        ("run.conf", '{"run": {"steps": 3}}', "this file looks like JSON"),
    ],
)
def test_config_files_in_other_formats_are_told_to_be_toml(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(file=path)
    assert f"config file {path}" in str(info.value) and "config files are TOML" in str(info.value)
    assert needle in str(info.value)


def test_a_broken_toml_file_is_not_called_yaml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nsteps = = 3\n')
    with pytest.raises(ConfigError) as info:
        load_config(file=bad)
    assert "line 2" in str(info.value) and "YAML" not in str(info.value)


def test_presets_choose_a_runs_directory_not_a_run_directory():
    tiny = load_config("tiny")
    assert tiny.run.out_dir is None and tiny.run.runs_dir == "runs/tiny"
    assert load_config("tiny", overrides=['run.out_dir="x"']).run.out_dir == "x"


def test_override_values_are_toml_or_strings():
    assert parse_override("a.b=0.5") == {"a": {"b": 0.5}}
    assert parse_override("a.b=true") == {"a": {"b": True}}
    assert parse_override("a.b=direct") == {"a": {"b": "direct"}}


def test_every_setting_is_documented():
    rows = describe_settings()
    assert len(rows) > 40
    assert all(desc for _, desc, _ in rows), [name for name, desc, _ in rows if not desc]
