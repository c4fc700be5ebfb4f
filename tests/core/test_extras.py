"""What a command needs and lacks is said in one line naming the extra (or torch), before work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core import extras
from miles_core.ci.register import register_cpu_ci
from miles_core.cli import main

register_cpu_ci(est_time=1, suite="stage-a-cpu")

README = Path(__file__).parents[2] / "README.md"


def test_a_missing_extra_is_named_with_its_install_command(monkeypatch) -> None:
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name: None if name in ("matplotlib", "numpy") else object())
    with pytest.raises(extras.MissingExtraError) as caught:
        extras.require("train", "miles train")
    message = str(caught.value)
    assert message == ("miles train needs the 'train' extra (matplotlib, numpy not installed): "
                       "pip install 'miles[train]'")
    assert caught.value.exit_code == 2


def test_torch_is_named_apart_since_no_extra_installs_it(monkeypatch) -> None:
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name: None if name == "torch" else object())
    with pytest.raises(extras.MissingExtraError, match=r"^miles engine needs torch, which is not installed: install the torch build"):
        extras.require("engine", "miles engine")


def test_an_escaping_module_error_becomes_one_line(monkeypatch, capsys) -> None:
    def needs_ray(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'ray'", name="ray")

    monkeypatch.setattr("miles_core.cli.cli.main", needs_ray)
    with pytest.raises(SystemExit) as exited:
        main(["train"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: ray is not installed; it comes with the 'ray' extra: pip install 'miles[ray]'"]


def test_a_module_miles_does_not_know_still_raises(monkeypatch) -> None:
    def needs_something(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'somethingelse'", name="somethingelse")

    monkeypatch.setattr("miles_core.cli.cli.main", needs_something)
    with pytest.raises(ModuleNotFoundError):
        main(["train"])


def test_every_environment_variable_of_the_readme_is_in_miles_help() -> None:
    table = README.read_text().split("## Environment", 1)[1].split("\n## ", 1)[0]
    variables = re.findall(r"^\| `(MILES_[A-Z_]+)", table, flags=re.M)
    assert len(variables) >= 6
    out = subprocess.run([sys.executable, "-m", "miles_core", "--help"], capture_output=True, text=True, check=True).stdout
    assert [v for v in variables if v not in out] == []
