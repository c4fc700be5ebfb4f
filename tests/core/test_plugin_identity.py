"""A plugin is (distribution, entry point): a second distribution cannot take over a name.

Real distributions (see conftest.py): ``miles-fixture-good`` declares the entry point
``fixture-good``; ``miles-fixture-impostor`` declares ``fixture-good`` too, plus ``core-tasks``
(the name of a built-in plugin). Each impostor module logs its import, so the tests can prove a
conflicting plugin's code never ran.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=8, suite="stage-a-cpu")

GOOD = "miles-fixture-good"
IMPOSTOR = "miles-fixture-impostor"


@pytest.fixture(scope="module")
def python(plugin_venv) -> Path:
    return plugin_venv("good", "impostor")


def listing(miles, python: Path, tmp_path: Path, **env: str) -> tuple[dict[tuple[str, str], dict], list[str]]:
    """``plugins list --json`` keyed by (name, distribution), and the impostor modules imported."""
    log = tmp_path / "imports.log"
    result = miles(python, "plugins", "list", "--json", MILES_FIXTURE_IMPORT_LOG=str(log), **env)
    assert result.returncode == 0, result.stderr
    plugins = {(p["name"], p["distribution"]): p for p in json.loads(result.stdout)["plugins"]}
    return plugins, log.read_text().split() if log.exists() else []


RESOLVE_TASK = """
import sys
from miles_core.errors import MilesError
from miles_core.plugins import get_plugin_manager
from miles_core.rl import registry
try:  # what `miles train` does first with its config: resolve (activate + verify) the task
    registry.resolve(get_plugin_manager(), "tasks", "arith-next", "task.name", "task")
except MilesError as exc:
    sys.exit(f"error: {exc}")
"""


def resolve_task(python: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")} | env
    return subprocess.run([str(python), "-c", RESOLVE_TASK], capture_output=True, text=True, env=environ, timeout=120)


def test_two_distributions_with_one_name_conflict_and_neither_loads(miles, python, tmp_path) -> None:
    plugins, imported = listing(miles, python, tmp_path)
    good, impostor = plugins[("fixture-good", GOOD)], plugins[("fixture-good", IMPOSTOR)]
    for record, other in ((good, IMPOSTOR), (impostor, GOOD)):
        assert record["status"] == "broken"
        assert [p["stage"] for p in record["problems"]] == ["conflict"]
        assert other in record["reason"]  # each names the other distribution
        assert record["contributes"] == {}  # neither gets the other's (or its own) contributions
    assert "miles_fixture_impostor.plugin" not in imported  # the clash is judged before importing
    assert not any("impostor-task" in p["contributes"].get("tasks", []) for p in plugins.values())


def test_the_conflict_fails_activation_naming_both_distributions(miles, python) -> None:
    result = resolve_task(python)
    assert result.returncode == 1, result.stdout
    assert GOOD in result.stderr and IMPOSTOR in result.stderr
    assert f"{IMPOSTOR}:fixture-good" in result.stderr  # how to name one of the two


@pytest.mark.parametrize(
    "deny",
    [IMPOSTOR, f"{IMPOSTOR}:fixture-good,{IMPOSTOR}:core-tasks", f"{IMPOSTOR},fixture-good"],
)
def test_denying_the_impostor_by_distribution_resolves_it(miles, python, tmp_path, deny) -> None:
    plugins, imported = listing(miles, python, tmp_path, MILES_DISABLE_PLUGINS=deny)
    impostor = plugins[("fixture-good", IMPOSTOR)]
    assert (impostor["status"], impostor["reason"]) == ("blocked", "disabled by MILES_DISABLE_PLUGINS")
    assert imported == []
    good = plugins[("fixture-good", GOOD)]
    if "fixture-good" in deny.split(","):  # the bare name names both plugins of that name
        assert good["status"] == "blocked"
    else:
        assert (good["status"], good["contributes"]) == ("ok", {"tasks": ["fixture-echo"]})
    assert resolve_task(python, MILES_DISABLE_PLUGINS=deny).returncode == 0


def test_denying_the_shared_name_blocks_both(miles, python, tmp_path) -> None:
    plugins, _ = listing(miles, python, tmp_path, MILES_DISABLE_PLUGINS=f"fixture-good,{IMPOSTOR}:core-tasks")
    assert plugins[("fixture-good", GOOD)]["status"] == plugins[("fixture-good", IMPOSTOR)]["status"] == "blocked"
    assert resolve_task(python, MILES_DISABLE_PLUGINS=f"fixture-good,{IMPOSTOR}:core-tasks").returncode == 0


@pytest.mark.parametrize("allow", [GOOD, f"{GOOD}:fixture-good"])
def test_allowing_one_distribution_loads_only_it(miles, python, tmp_path, allow) -> None:
    plugins, imported = listing(miles, python, tmp_path, MILES_PLUGINS=allow)
    assert plugins[("fixture-good", GOOD)]["status"] == "ok"
    assert plugins[("fixture-good", IMPOSTOR)]["status"] == "blocked"
    assert plugins[("core-tasks", IMPOSTOR)]["status"] == "blocked"
    assert imported == []
    assert resolve_task(python, MILES_PLUGINS=allow).returncode == 0


def test_allowing_the_shared_name_is_still_a_conflict(miles, python, tmp_path) -> None:
    plugins, imported = listing(miles, python, tmp_path, MILES_PLUGINS="fixture-good")
    assert plugins[("fixture-good", GOOD)]["status"] == plugins[("fixture-good", IMPOSTOR)]["status"] == "broken"
    assert "miles_fixture_impostor.plugin" not in imported
    result = resolve_task(python, MILES_PLUGINS="fixture-good")
    assert result.returncode == 1 and IMPOSTOR in result.stderr


def test_a_builtin_name_stays_the_builtins(miles, python, tmp_path) -> None:
    plugins, imported = listing(miles, python, tmp_path, MILES_DISABLE_PLUGINS=f"{IMPOSTOR}:fixture-good")
    builtin, squat = plugins[("core-tasks", "miles")], plugins[("core-tasks", IMPOSTOR)]
    assert builtin["status"] == "ok" and builtin["contributes"] == {"tasks": ["arith-add", "arith-next"]}
    assert squat["status"] == "broken" and "built-in plugin" in squat["reason"]
    assert "miles_fixture_impostor.builtin_squat" not in imported
    result = resolve_task(python, MILES_DISABLE_PLUGINS=f"{IMPOSTOR}:fixture-good")
    assert result.returncode == 1 and f"{IMPOSTOR}:core-tasks" in result.stderr


def test_show_asks_which_of_two_same_named_plugins(miles, python) -> None:
    ambiguous = miles(python, "plugins", "show", "fixture-good")
    assert ambiguous.returncode == 2
    assert f"{GOOD}:fixture-good" in ambiguous.stderr and f"{IMPOSTOR}:fixture-good" in ambiguous.stderr
    one = miles(python, "plugins", "show", f"{IMPOSTOR}:fixture-good", "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["distribution"] == IMPOSTOR
