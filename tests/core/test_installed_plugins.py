"""Real distributions (see conftest.py): a good and a broken fixture plugin installed in a venv."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=25, suite="stage-a-cpu")


@pytest.fixture(scope="module")
def venv_python(plugin_venv) -> Path:
    return plugin_venv("good", "broken")


def plugins_by_name(result: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    assert result.returncode == 0, result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)["plugins"]}


def test_installed_plugin_is_discovered_and_contributes(venv_python: Path, miles) -> None:
    plugins = plugins_by_name(miles(venv_python, "plugins", "list", "--json"))
    good = plugins["fixture-good"]
    assert good["status"] == "ok"
    assert (good["distribution"], good["version"]) == ("miles-fixture-good", "3.1.4")
    assert good["contributes"] == {"tasks": ["fixture-echo"]}
    assert good["builtin"] is False


def test_broken_plugin_is_listed_with_its_error(venv_python: Path, miles) -> None:
    plugins = plugins_by_name(miles(venv_python, "plugins", "list", "--json"))
    broken = plugins["fixture-broken"]
    assert broken["status"] == "broken"
    assert "RuntimeError: fixture-broken exploded at import time" in broken["reason"]
    table = miles(venv_python, "plugins", "list")
    assert table.returncode == 0 and "fixture-broken" in table.stdout


def test_doctor_fails_naming_the_broken_plugin(venv_python: Path, miles) -> None:
    result = miles(venv_python, "doctor", "--json")
    assert result.returncode == 1
    failed = [r for r in json.loads(result.stdout)["results"] if r["status"] == "fail"]
    assert any(r["item"] == "fixture-broken" and "exploded at import time" in r["detail"] for r in failed)


def test_deny_list_skips_the_import_entirely(venv_python: Path, miles) -> None:
    result = miles(venv_python, "plugins", "list", "--json", MILES_DISABLE_PLUGINS="fixture-broken")
    broken = plugins_by_name(result)["fixture-broken"]
    assert (broken["status"], broken["reason"]) == ("blocked", "disabled by MILES_DISABLE_PLUGINS")
    assert broken["problems"] == []  # never imported, so it never raised


def test_allow_list_keeps_only_named_plugins(venv_python: Path, miles) -> None:
    plugins = plugins_by_name(
        miles(venv_python, "plugins", "list", "--json", MILES_PLUGINS="miles-fixture-good")
    )
    assert plugins["fixture-good"]["status"] == "ok"  # allowed by distribution name
    third_party = {n: p["status"] for n, p in plugins.items() if not p["builtin"] and n != "fixture-good"}
    assert third_party and set(third_party.values()) == {"blocked"}


def test_strict_mode_lists_with_its_verdict_and_fails_other_commands(venv_python: Path, miles) -> None:
    listing = miles(venv_python, "plugins", "list", "--json", MILES_PLUGIN_ERRORS="raise")
    assert listing.returncode == 0, listing.stderr  # listing is diagnostic: it still lists
    doc = json.loads(listing.stdout)
    assert doc["strict"] == {"policy": "raise", "passes": False, "broken": ["miles-fixture-broken:fixture-broken"]}
    assert {p["name"]: p["status"] for p in doc["plugins"]}["fixture-good"] == "ok"  # listed past the error
    table = miles(venv_python, "plugins", "list", MILES_PLUGIN_ERRORS="raise")
    assert table.returncode == 0
    assert "MILES_PLUGIN_ERRORS=raise: every command that loads plugins fails" in table.stdout
    shown = miles(venv_python, "plugins", "show", "fixture-broken", MILES_PLUGIN_ERRORS="raise")
    assert shown.returncode == 0 and "exploded at import time" in shown.stdout
    # any other command that loads plugins stops at the first error, naming it
    result = miles(venv_python, "train", "--preset", "tiny", "--print-config", MILES_PLUGIN_ERRORS="raise")
    assert result.returncode == 1
    assert "fixture-broken" in result.stderr and "exploded at import time" in result.stderr
    assert result.stdout == ""


def test_strict_mode_passes_when_nothing_is_broken(venv_python: Path, miles) -> None:
    listing = miles(venv_python, "plugins", "list", "--json", MILES_PLUGIN_ERRORS="raise",
                    MILES_DISABLE_PLUGINS="fixture-broken")
    assert json.loads(listing.stdout)["strict"] == {"policy": "raise", "passes": True, "broken": []}
    assert miles(venv_python, "train", "--preset", "tiny", "--print-config", MILES_PLUGIN_ERRORS="raise",
                 MILES_DISABLE_PLUGINS="fixture-broken").returncode == 0
