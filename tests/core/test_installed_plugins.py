"""Real distributions: fixture plugins built as wheels and installed into a temporary venv.

The venv sees this environment's packages (miles and its dependencies) through a ``.pth`` file,
so nothing is downloaded; the fixture plugins are discovered only through their entry points.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=25, suite="stage-a-cpu")

FIXTURES = Path(__file__).parent.parent / "fixtures" / "plugins"


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugin-venv")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "_miles_outer.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in outer)
    )
    wheels = root / "wheels"
    for name in ("good", "broken"):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-q",
                "-w",
                str(wheels),
                str(FIXTURES / name),
            ],
            check=True,
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--target",
            str(purelib),
            *map(str, sorted(wheels.glob("*.whl"))),
        ],
        check=True,
    )
    return python


def miles(python: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")} | env
    return subprocess.run(
        [str(python), "-m", "miles_core", *args], capture_output=True, text=True, env=environ
    )


def plugins_by_name(result: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    assert result.returncode == 0, result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)["plugins"]}


def test_installed_plugin_is_discovered_and_contributes(venv_python: Path) -> None:
    plugins = plugins_by_name(miles(venv_python, "plugins", "list", "--json"))
    good = plugins["fixture-good"]
    assert good["status"] == "ok"
    assert (good["distribution"], good["version"]) == ("miles-fixture-good", "3.1.4")
    assert good["contributes"] == {"tasks": ["fixture-echo"]}
    assert good["builtin"] is False


def test_broken_plugin_is_listed_with_its_error(venv_python: Path) -> None:
    plugins = plugins_by_name(miles(venv_python, "plugins", "list", "--json"))
    broken = plugins["fixture-broken"]
    assert broken["status"] == "broken"
    assert "RuntimeError: fixture-broken exploded at import time" in broken["reason"]
    table = miles(venv_python, "plugins", "list")
    assert table.returncode == 0 and "fixture-broken" in table.stdout


def test_doctor_fails_naming_the_broken_plugin(venv_python: Path) -> None:
    result = miles(venv_python, "doctor", "--json")
    assert result.returncode == 1
    failed = [r for r in json.loads(result.stdout)["results"] if r["status"] == "fail"]
    assert any(r["item"] == "fixture-broken" and "exploded at import time" in r["detail"] for r in failed)


def test_deny_list_skips_the_import_entirely(venv_python: Path) -> None:
    result = miles(venv_python, "plugins", "list", "--json", MILES_DISABLE_PLUGINS="fixture-broken")
    broken = plugins_by_name(result)["fixture-broken"]
    assert (broken["status"], broken["reason"]) == ("blocked", "disabled by MILES_DISABLE_PLUGINS")
    assert broken["problems"] == []  # never imported, so it never raised


def test_allow_list_keeps_only_named_plugins(venv_python: Path) -> None:
    plugins = plugins_by_name(
        miles(venv_python, "plugins", "list", "--json", MILES_PLUGINS="miles-fixture-good")
    )
    assert plugins["fixture-good"]["status"] == "ok"  # allowed by distribution name
    third_party = {n: p["status"] for n, p in plugins.items() if not p["builtin"] and n != "fixture-good"}
    assert third_party and set(third_party.values()) == {"blocked"}


def test_strict_mode_fails_the_command(venv_python: Path) -> None:
    result = miles(venv_python, "plugins", "list", "--json", MILES_PLUGIN_ERRORS="raise")
    assert result.returncode == 1
    assert "fixture-broken" in result.stderr and "exploded at import time" in result.stderr
