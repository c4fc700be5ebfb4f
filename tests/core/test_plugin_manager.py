"""The plugin manager: attribution, error isolation, filters, strict mode, fail-closed activation."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ActivationError, ConfigError, PluginLoadError
from miles_core.plugins import MilesPluginManager, fingerprint_mismatch, get_plugin_manager
from miles_core.testing import plugin_module as make_plugin

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@dataclass
class Thing:
    """A minimal contribution: a name and a verify() whose outcome the test controls."""

    name: str
    fail_with: str | None = None
    verified: list[str] = field(default_factory=list)

    def verify(self) -> None:
        if self.fail_with:
            raise RuntimeError(self.fail_with)
        self.verified.append(self.name)


def test_contributions_are_attributed_to_their_plugin(miles_pm: MilesPluginManager) -> None:
    miles_pm.register(
        make_plugin("a", miles_sandbox_providers=lambda: [Thing("one")]),
        name="a",
        distribution="dist-a",
        version="1.2",
    )
    miles_pm.register(
        make_plugin("b", miles_sandbox_providers=lambda: [Thing("two"), Thing("three")]), name="b"
    )
    got = {c.name: c.plugin.name for c in miles_pm.contributions("sandbox")}
    assert got == {"one": "a", "two": "b", "three": "b"}
    assert miles_pm.get("a").contributes == {"sandbox": ["one"]}
    assert miles_pm.get("dist-a").name == "a"  # lookup by distribution name too
    assert get_plugin_manager() is miles_pm  # the fixture installs it process-wide


def test_a_raising_hook_breaks_only_that_plugin(miles_pm: MilesPluginManager) -> None:
    def boom() -> list[Thing]:
        raise ValueError("no backends today")

    miles_pm.register(make_plugin("bad", miles_hardware_backends=boom), name="bad")
    miles_pm.register(make_plugin("good", miles_hardware_backends=lambda: [Thing("x")]), name="good")
    assert [c.name for c in miles_pm.contributions("hardware")] == ["x"]
    bad = miles_pm.get("bad")
    assert bad.status == "broken"
    assert "ValueError: no backends today" in bad.reason
    assert miles_pm.get("good").status == "ok"
    # listing another concern is unaffected; activating hardware fails closed naming the plugin
    assert miles_pm.contributions("sandbox") == []
    with pytest.raises(PluginLoadError, match=r"plugin 'bad'.*MILES_DISABLE_PLUGINS=bad"):
        miles_pm.active_contributions("hardware")


def test_hook_error_in_one_concern_does_not_block_another(miles_pm: MilesPluginManager) -> None:
    def boom() -> list[Thing]:
        raise RuntimeError("x")

    miles_pm.register(
        make_plugin("p", miles_hardware_backends=boom, miles_sandbox_providers=lambda: [Thing("s")]), name="p"
    )
    assert [c.name for c in miles_pm.active_contributions("sandbox")] == ["s"]
    with pytest.raises(PluginLoadError):
        miles_pm.active_contributions("hardware")


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (None, "returned None"),
        ("abc", "must return a list"),
        ([object()], "without a non-empty str 'name'"),
        ([type("NoVerify", (), {"name": "n"})()], "without a callable verify"),
    ],
)
def test_malformed_contributions_are_rejected(
    miles_pm: MilesPluginManager, result: object, message: str
) -> None:
    miles_pm.register(make_plugin("m", miles_tasks=lambda: result), name="m")
    assert miles_pm.contributions("tasks") == []
    assert message in miles_pm.get("m").reason


def test_duplicate_contribution_names_conflict(miles_pm: MilesPluginManager) -> None:
    miles_pm.register(make_plugin("first", miles_tasks=lambda: [Thing("t")]), name="first")
    miles_pm.register(make_plugin("second", miles_tasks=lambda: [Thing("t")]), name="second")
    assert [c.plugin.name for c in miles_pm.contributions("tasks")] == ["first"]
    assert "already provided by plugin 'first'" in miles_pm.get("second").reason


def test_unknown_hook_is_a_registration_error(miles_pm: MilesPluginManager) -> None:
    miles_pm.register(make_plugin("typo", miles_hardware_backend=lambda: []), name="typo")
    record = miles_pm.get("typo")
    assert record.status == "broken"
    assert "unknown hook(s) miles_hardware_backend" in record.reason


def test_allow_and_deny_lists(miles_pm_factory) -> None:
    plugins = [
        ("core-x", make_plugin("cx", miles_tasks=lambda: [Thing("core")])),
    ]
    pm = miles_pm_factory(allow=["wanted"], deny=["unwanted"])
    pm.register(plugins[0][1], name="core-x", distribution="miles", builtin=True)
    pm.register(make_plugin("w", miles_tasks=lambda: [Thing("w")]), name="wanted", distribution="wanted-dist")
    pm.register(make_plugin("o", miles_tasks=lambda: [Thing("o")]), name="other")
    pm.register(make_plugin("u", miles_tasks=lambda: [Thing("u")]), name="unwanted")
    statuses = {r.name: (r.status, r.reason) for r in pm.plugins()}
    assert statuses["core-x"] == ("ok", None)  # built-ins ignore the allow list
    assert statuses["wanted"] == ("ok", None)
    assert statuses["other"] == ("blocked", "not in MILES_PLUGINS")
    assert statuses["unwanted"] == ("blocked", "disabled by MILES_DISABLE_PLUGINS")
    assert sorted(c.name for c in pm.active_contributions("tasks")) == ["core", "w"]


def test_deny_list_applies_to_builtins_and_by_distribution(miles_pm_factory) -> None:
    pm = miles_pm_factory(deny=["miles"])
    pm.register(
        make_plugin("c", miles_tasks=lambda: [Thing("c")]), name="core-x", distribution="miles", builtin=True
    )
    assert pm.get("core-x").status == "blocked"
    assert pm.contributions("tasks") == []


def test_environment_parsing() -> None:
    pm = MilesPluginManager.from_environment(
        {"MILES_PLUGINS": " a, b ,", "MILES_DISABLE_PLUGINS": "c", "MILES_PLUGIN_ERRORS": "RAISE"}
    )
    assert pm.allow == {"a", "b"} and pm.deny == {"c"} and pm.errors == "raise"
    assert MilesPluginManager.from_environment({}).allow is None
    with pytest.raises(ConfigError, match="MILES_PLUGIN_ERRORS must be 'record' or 'raise', got 'loud'"):
        MilesPluginManager.from_environment({"MILES_PLUGIN_ERRORS": "loud"})


def test_strict_mode_raises_on_first_error(miles_pm_factory) -> None:
    pm = miles_pm_factory(errors="raise")

    def boom() -> list[Thing]:
        raise KeyError("k")

    pm.register(make_plugin("s", miles_tasks=boom), name="strict-victim", distribution="sv", version="0.3")
    with pytest.raises(
        PluginLoadError, match=r"'strict-victim' \(sv 0.3\) is broken: hook: miles_tasks raised KeyError"
    ):
        pm.contributions("tasks")


def test_verify_failure_fails_closed_with_provenance(miles_pm: MilesPluginManager) -> None:
    thing = Thing("gadget", fail_with="marker missing on Foo")
    miles_pm.register(
        make_plugin("v", miles_sandbox_providers=lambda: [thing]),
        name="vp",
        distribution="vp-dist",
        version="9.9",
    )
    contribution = miles_pm.contribution("sandbox", "gadget")
    with pytest.raises(ActivationError) as info:
        miles_pm.verify(contribution, thing.verify)
    err = info.value
    assert (err.plugin, err.distribution, err.version, err.obj) == ("vp", "vp-dist", "9.9", "gadget")
    assert "marker missing on Foo" in str(err) and "vp-dist 9.9" in str(err)
    assert miles_pm.get("vp").status == "broken"  # recorded, so `plugins list`/doctor show it


def test_verify_success_returns_value(miles_pm: MilesPluginManager) -> None:
    thing = Thing("fine")
    miles_pm.register(make_plugin("f", miles_sandbox_providers=lambda: [thing]), name="f")
    miles_pm.verify(miles_pm.contribution("sandbox", "fine"), thing.verify)
    assert thing.verified == ["fine"]


def test_unknown_contribution_names_known_ones(miles_pm: MilesPluginManager) -> None:
    miles_pm.register(make_plugin("k", miles_tasks=lambda: [Thing("alpha"), Thing("beta")]), name="k")
    with pytest.raises(ConfigError, match=r"no tasks named 'gamma' is registered \(known: alpha, beta\)"):
        miles_pm.contribution("tasks", "gamma")


def test_fingerprint_tracks_plugins_versions_and_patches(miles_pm_factory) -> None:
    def build(version: str) -> MilesPluginManager:
        pm = miles_pm_factory()
        pm.register(make_plugin("p", miles_tasks=lambda: []), name="p", distribution="p", version=version)
        return pm

    a, b, c = build("1.0"), build("1.0"), build("1.1")
    assert a.fingerprint() == b.fingerprint()
    assert fingerprint_mismatch(a.fingerprint(), b.fingerprint()) == []
    assert fingerprint_mismatch(a.fingerprint(), c.fingerprint()) == [
        "plugin p: expected ['p', 'p', '1.0', 'ok'], found ['p', 'p', '1.1', 'ok']"
    ]
    b.record_applied_patch("gdn-packing", ["Qwen3_5GatedDeltaNet"])
    assert a.fingerprint()["digest"] != b.fingerprint()["digest"]
    assert fingerprint_mismatch(a.fingerprint(), b.fingerprint()) == [
        "patch gdn-packing: expected None, found ['Qwen3_5GatedDeltaNet']"
    ]


def test_duplicate_registration_name_is_rejected(miles_pm: MilesPluginManager) -> None:
    miles_pm.register(make_plugin("x"), name="x")
    with pytest.raises(ValueError, match="already registered"):
        miles_pm.register(make_plugin("x2"), name="x")


def test_unknown_filter_names_are_warned(miles_pm_factory) -> None:
    pm = miles_pm_factory(allow=["typo-plugin"])
    pm.register(make_plugin("real"), name="real")
    pm._warn_unknown_filters()
    assert pm.warnings == ["MILES_PLUGINS names 'typo-plugin', which is not an installed plugin"]


# -- pluggy as designed: ordering, wrappers, validation ------------------------------------------


def _impl(name: str, fn, **opts) -> object:
    """A plugin module whose one hook implementation carries pluggy options (tryfirst, wrapper...)."""
    import types

    from miles_core.hookspecs import hookimpl

    module = types.ModuleType(name)
    fn.__name__ = fn.__name__ if fn.__name__ != "<lambda>" else opts.pop("hook")
    setattr(module, fn.__name__, hookimpl(**opts)(fn))
    return module


def test_a_tryfirst_contribution_replaces_a_plain_one_of_the_same_name(miles_pm: MilesPluginManager) -> None:
    def miles_tasks() -> list[Thing]:
        return [Thing("t"), Thing("mine-only")]

    miles_pm.register(make_plugin("core", miles_tasks=lambda: [Thing("t"), Thing("other")]), name="core")
    miles_pm.register(_impl("fast", miles_tasks, tryfirst=True), name="fast")
    by_name = {c.name: c.plugin.name for c in miles_pm.active_contributions("tasks")}
    assert by_name == {"t": "fast", "mine-only": "fast", "other": "core"}
    assert [c.plugin.name for c in miles_pm.contributions("tasks")][:2] == ["fast", "fast"]  # tryfirst first
    core = miles_pm.get("core")
    assert core.status == "ok" and core.shadowed == {"tasks": ["t (by fast)"]}
    assert core.contributes == {"tasks": ["other"]}


def test_a_trylast_contribution_loses_to_a_plain_one(miles_pm: MilesPluginManager) -> None:
    def miles_tasks() -> list[Thing]:
        return [Thing("t")]

    miles_pm.register(_impl("fallback", miles_tasks, trylast=True), name="fallback")
    miles_pm.register(make_plugin("normal", miles_tasks=lambda: [Thing("t")]), name="normal")
    assert miles_pm.contribution("tasks", "t").plugin.name == "normal"
    assert miles_pm.get("fallback").shadowed == {"tasks": ["t (by normal)"]}


def test_tryfirst_orders_the_calls(miles_pm: MilesPluginManager) -> None:
    calls: list[str] = []

    def plain() -> list[Thing]:
        calls.append("plain")
        return []

    def first() -> list[Thing]:
        calls.append("first")
        return []

    def last() -> list[Thing]:
        calls.append("last")
        return []

    for fn, name, opts in ((last, "l", {"trylast": True}), (plain, "p", {}), (first, "f", {"tryfirst": True})):
        fn.__name__ = "miles_tasks"
        miles_pm.register(_impl(name, fn, **opts), name=name)
    miles_pm.contributions("tasks")
    assert calls == ["first", "plain", "last"]


def test_a_wrapper_wraps_each_plugins_call_and_keeps_attribution(miles_pm: MilesPluginManager) -> None:
    seen: list[list[str]] = []

    def miles_tasks():
        results = yield
        seen.append([t.name for result in results for t in result])
        return [[t for t in result if t.name != "hidden"] for result in results]

    miles_pm.register(make_plugin("a", miles_tasks=lambda: [Thing("x"), Thing("hidden")]), name="a")
    miles_pm.register(make_plugin("b", miles_tasks=lambda: [Thing("y")]), name="b")
    miles_pm.register(_impl("filter", miles_tasks, wrapper=True), name="filter")
    got = {c.name: c.plugin.name for c in miles_pm.active_contributions("tasks")}
    assert got == {"x": "a", "y": "b"}
    assert sorted(seen) == [["x", "hidden"], ["y"]]  # one call per plugin, each wrapped


def test_a_raising_wrapper_is_blamed_and_left_out(miles_pm: MilesPluginManager) -> None:
    def miles_tasks():
        yield
        raise RuntimeError("wrapper bug")

    miles_pm.register(make_plugin("a", miles_tasks=lambda: [Thing("x")]), name="a")
    miles_pm.register(_impl("bad-wrapper", miles_tasks, wrapper=True), name="bad-wrapper")
    assert [c.name for c in miles_pm.contributions("tasks")] == ["x"]  # a's contribution survives
    assert miles_pm.get("a").status == "ok"
    assert "miles_tasks wrapper raised RuntimeError: wrapper bug" in miles_pm.get("bad-wrapper").reason


def test_an_error_passing_through_a_wrapper_is_the_implementations(miles_pm: MilesPluginManager) -> None:
    def boom() -> list[Thing]:
        raise ValueError("impl bug")

    def miles_tasks():
        return (yield)

    miles_pm.register(make_plugin("broken", miles_tasks=boom), name="broken")
    miles_pm.register(make_plugin("fine", miles_tasks=lambda: [Thing("ok")]), name="fine")
    miles_pm.register(_impl("observer", miles_tasks, wrapper=True), name="observer")
    assert [c.name for c in miles_pm.contributions("tasks")] == ["ok"]
    assert "ValueError: impl bug" in miles_pm.get("broken").reason
    assert miles_pm.get("observer").status == "ok"


def test_unknown_hooks_fail_pluggys_validation_unless_optional(miles_pm: MilesPluginManager) -> None:
    def miles_from_the_future() -> list[Thing]:
        return []

    miles_pm.register(_impl("newer", miles_from_the_future, optionalhook=True), name="newer")
    assert miles_pm.get("newer").status == "ok"
    miles_pm.register(make_plugin("typo", miles_algorithm=lambda: []), name="typo")
    reason = miles_pm.get("typo").reason
    assert "unknown hook(s) miles_algorithm" in reason and "unknown hook 'miles_algorithm'" in reason  # pluggy's words


def test_the_new_concerns_are_collected(miles_pm_factory) -> None:
    pm = miles_pm_factory(builtins=True)
    names = {concern: sorted(c.name for c in pm.contributions(concern))
             for concern in ("algorithms", "rollout", "trainer", "orchestrator", "trackers")}
    assert names == {
        "algorithms": ["dr-grpo", "grpo", "gspo"],
        "rollout": ["agentic", "direct"],
        "trainer": ["hf", "megatron"],
        "orchestrator": ["inprocess", "ray"],
        "trackers": ["jsonl", "mlflow", "tensorboard", "wandb"],
    }
    assert pm.get("core-rl").contributes["algorithms"] == ["grpo", "dr-grpo", "gspo"]
