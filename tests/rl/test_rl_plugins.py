"""The RL step as plugins: built-ins conform, the registries resolve config names, a plugin's
tryfirst algorithm replaces the built-in, broken third-party algorithms are named and fail
closed while other commands keep working, trainer backends prove one update moves the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.cli import main
from miles_core.errors import ActivationError, ConfigError, PluginLoadError
from miles_core.hookspecs import hookimpl
from miles_core.rl import registry
from miles_core.rl.algorithms.builtin import BUILTIN_ALGORITHMS, GRPO
from miles_core.rl.config import load_config
from miles_core.rl.rollout.builtin import DirectRolloutFunction
from miles_core.testing import plugin_module
from miles_core.testing.algorithms import assert_algorithm_conforms
from miles_core.testing.rollout import assert_rollout_conforms

register_cpu_ci(est_time=10, suite="stage-a-cpu")


@dataclass(frozen=True)
class WrongSign(GRPO):
    """GRPO with its loss negated -- rewarded samples would be made *less* likely -- documenting the
    value it computes, so only the gradient-sign check can catch it."""

    name: str = "wrong-sign"
    probe_loss: float = -0.1673526

    def policy_loss(self, batch, settings):
        loss = super().policy_loss(batch, settings)
        return replace(loss, per_token=-loss.per_token)


@dataclass(frozen=True)
class NoLogprobs:
    """A rollout function that cannot report the sampler's log-probs (an API without them)."""

    name: str = "no-logprobs"
    description: str = "token ids only"
    provides: frozenset = frozenset({"token_ids", "loss_mask"})
    settings: frozenset = frozenset()
    session_server: bool = False

    def start(self, context):
        raise NotImplementedError

    def verify(self) -> None:
        pass


def run_cli(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@pytest.mark.parametrize("algorithm", BUILTIN_ALGORITHMS, ids=lambda a: a.name)
def test_builtin_algorithms_conform_with_their_documented_probe_loss(algorithm) -> None:
    assert_algorithm_conforms(algorithm, expected_loss=algorithm.probe_loss)


def test_the_docs_state_each_probe_loss() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "train.md").read_text()
    for algorithm in BUILTIN_ALGORITHMS:
        assert f"| `{algorithm.name}` |" in doc and f"{algorithm.probe_loss:.7f}"[:8] in doc, algorithm.name


def test_a_wrong_gradient_sign_fails_verification() -> None:
    with pytest.raises(AssertionError, match="raising the rewarded sample's log-prob must lower the loss"):
        WrongSign().verify()


def test_direct_rollout_is_token_exact() -> None:
    trajectories = assert_rollout_conforms(DirectRolloutFunction())
    assert len(trajectories) == 6


def test_a_plugins_tryfirst_algorithm_replaces_the_builtin(miles_pm_factory, tmp_path) -> None:
    mine = replace(WrongSign(), name="grpo")  # a (deliberately odd) grpo of the plugin's own

    class Plugin:
        @hookimpl(tryfirst=True)
        def miles_algorithms(self):
            return [mine]

    pm = miles_pm_factory(builtins=True)
    pm.register(Plugin(), name="my-grpo", distribution="my-grpo", version="1.0")
    config = load_config("tiny", pm=pm)
    assert pm.contribution("algorithms", "grpo").plugin.name == "my-grpo"
    assert pm.get("core-rl").shadowed == {"algorithms": ["grpo (by my-grpo)"]}
    # the run would use it: resolving verifies it, and its wrong sign is caught with provenance
    with pytest.raises(ActivationError, match=r"plugin 'my-grpo' \(my-grpo 1.0\): algorithms 'grpo' failed verification"):
        registry.algorithm(pm, config)


def test_without_tryfirst_the_same_name_is_a_conflict(miles_pm_factory) -> None:
    pm = miles_pm_factory(builtins=True)
    pm.register(plugin_module("dup", miles_algorithms=lambda: [GRPO()]), name="dup")
    assert pm.contribution  # the built-in keeps the name; the late plugin is broken for the concern
    assert [c.plugin.name for c in pm.contributions("algorithms") if c.name == "grpo"] == ["core-rl"]
    assert "already provided by plugin 'core-rl'" in pm.get("dup").reason
    with pytest.raises(PluginLoadError, match="MILES_DISABLE_PLUGINS=dup"):
        registry.algorithm(pm, load_config("tiny", pm=pm))


def test_a_broken_third_party_algorithm_is_listed_and_other_commands_keep_working(miles_pm_factory, capsys) -> None:
    def boom():
        raise RuntimeError("cannot build my algorithm")

    pm = miles_pm_factory(builtins=True)
    pm.register(plugin_module("bad", miles_algorithms=boom), name="bad-algo", distribution="bad-algo", version="0.1")
    code, out, _ = run_cli(["plugins", "list", "--json"], capsys)
    assert code == 0
    bad = {p["name"]: p for p in json.loads(out)["plugins"]}["bad-algo"]
    assert bad["status"] == "broken" and "miles_algorithms raised RuntimeError: cannot build my algorithm" in bad["reason"]
    code, out, _ = run_cli(["train", "--preset", "tiny", "--print-config"], capsys)
    assert code == 0 and json.loads(out)["algorithm"]["name"] == "grpo"
    code, out, _ = run_cli(["engine", "presets", "--json"], capsys)
    assert code == 0
    # training needs the algorithms concern: it fails closed, naming the plugin and the way out
    with pytest.raises(PluginLoadError, match=r"plugin 'bad-algo' \(bad-algo 0.1\) is broken.*MILES_DISABLE_PLUGINS=bad-algo"):
        registry.algorithm(pm, load_config("tiny", pm=pm))


def test_an_algorithm_failing_verification_is_named_by_train_and_doctor(miles_pm_factory, tmp_path, capsys) -> None:
    pm = miles_pm_factory(builtins=True)
    pm.register(plugin_module("ws", miles_algorithms=lambda: [WrongSign()]), name="ws", distribution="ws-dist",
                version="2.0")
    code, _, err = run_cli(["train", "--preset", "tiny", "--set", "algorithm.name=wrong-sign", "--out",
                            str(tmp_path / "run")], capsys)
    assert code == 1
    assert "plugin 'ws' (ws-dist 2.0): algorithms 'wrong-sign' failed verification" in err
    assert "rewarded sample's log-prob must lower the loss" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert pm.get("ws").status == "broken"  # recorded: the concern now fails closed in this process
    from miles_core.rl.doctor import _verified

    pm = miles_pm_factory(builtins=True)
    pm.register(plugin_module("ws", miles_algorithms=lambda: [WrongSign()]), name="ws")
    result = _verified(pm, next(c for c in pm.contributions("algorithms") if c.name == "wrong-sign"), "algorithm")
    assert (result.status, result.plugin) == ("fail", "ws") and "must lower the loss" in result.detail
    grpo = _verified(pm, next(c for c in pm.contributions("algorithms") if c.name == "grpo"), "algorithm")
    assert grpo.status == "ok"


def test_names_resolve_through_the_registries(miles_pm_factory) -> None:
    @dataclass(frozen=True)
    class MyBackend:
        name: str = "jax"
        description: str = "a third party's"
        settings: frozenset = frozenset({"compile"})

        def create(self, *args):
            raise NotImplementedError

        def verify(self) -> None:
            pass

    pm = miles_pm_factory(builtins=True)
    pm.register(plugin_module("jax", miles_trainer_backends=lambda: [MyBackend()],
                              miles_rollout_functions=lambda: [NoLogprobs()]), name="jax")
    config = load_config("tiny", overrides=['trainer.backend="jax"', "trainer.compile=true"], pm=pm)
    assert config.trainer.backend == "jax"  # a plugin's name, and a setting it declares it reads
    with pytest.raises(ConfigError, match=r"trainer.world_size > 1 needs trainer.backend = 'hf' \(trainer.backend 'jax'"):
        load_config("tiny", overrides=['trainer.backend="jax"', "trainer.world_size=2"], pm=pm)
    with pytest.raises(ConfigError, match=r"'grpo' needs rollout field\(s\) rollout_logprobs, which rollout.path 'no-logprobs'"):
        load_config("tiny", overrides=['rollout.path="no-logprobs"', "rollout.session_version=\"v1\""], pm=pm)
    with pytest.raises(ConfigError, match=r"rollout.samples_per_prompt must be >= 2 for dr-grpo"):
        load_config("tiny", overrides=['algorithm.name="dr-grpo"', "rollout.samples_per_prompt=1"], pm=pm)


def test_an_algorithms_own_defaults_apply_unless_a_layer_sets_them(miles_pm_factory) -> None:
    pm = miles_pm_factory(builtins=True)
    gspo = load_config("tiny", overrides=['algorithm.name="gspo"'], pm=pm)
    assert (gspo.algorithm.clip_low, gspo.algorithm.clip_high) == (3e-4, 4e-4)
    mine = load_config("tiny", overrides=['algorithm.name="gspo"', "algorithm.clip_high=0.01"], pm=pm)
    assert (mine.algorithm.clip_low, mine.algorithm.clip_high) == (3e-4, 0.01)
    assert load_config("tiny", pm=pm).algorithm.clip_low == 0.2
    with pytest.raises(ConfigError, match=r"algorithm.scale_by_std needs algorithm.name in \['grpo', 'gspo'\]"):
        load_config("tiny", overrides=['algorithm.name="dr-grpo"', "algorithm.scale_by_std=false"], pm=pm)


def test_the_hf_backend_proves_one_update_moves_the_weights() -> None:
    from miles_core.rl.trainers.builtin import HFBackend
    from miles_core.rl.trainers.probe import check_one_update

    change = check_one_update(HFBackend())
    assert change["rewarded"] > 0 > change["unrewarded"]


def test_a_backend_whose_update_does_not_reach_the_engine_fails_verification() -> None:
    """Negative control: a trainer that trains but hands the engine its initial weights."""
    from miles_core.rl.trainers.builtin import HFBackend
    from miles_core.rl.trainers.probe import check_one_update

    @dataclass(frozen=True)
    class Stale(HFBackend):
        name: str = "hf"
        snapshot: dict = field(default_factory=dict)

        def create(self, model_dir, config, device, algorithm):
            trainer = super().create(model_dir, config, device, algorithm)
            initial = {k: v.clone() for k, v in trainer.engine_weights().items()}
            trainer.engine_weights = lambda: initial
            return trainer

    with pytest.raises(AssertionError, match="expected up / down"):
        check_one_update(Stale())
