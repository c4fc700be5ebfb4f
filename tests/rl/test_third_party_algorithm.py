"""docs/plugins.md's worked example, as a user would run it: the third-party distribution
miles-rloo written from the page, installed editable, discovered through its entry point, checked
with the conformance kit, and trained end to end with `miles train --preset tiny --set
algorithm.name=rloo` to >= 0.9 greedy accuracy."""

from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=23, suite="stage-b-cpu")

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def doc_files() -> dict[str, str]:
    """The worked example's files: every code block of docs/plugins.md whose first line names one."""
    files = {}
    for body in re.findall(r"```(?:toml|python)\n(.*?)```", DOC.read_text(), flags=re.S):
        first = body.splitlines()[0]
        match = re.match(r"# (pyproject\.toml|miles_rloo/[\w/]+\.py)", first)
        if match:
            files[match.group(1)] = body
    return files


@pytest.fixture(scope="module")
def rloo_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A venv that sees this environment's packages, with miles-rloo installed editable."""
    root = tmp_path_factory.mktemp("rloo")
    source = root / "miles-rloo"
    for name, body in doc_files().items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(body)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "_miles_outer.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in outer))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "--prefix", str(venv), "-e", str(source)], check=True)
    return python, source


def miles(python: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")} | env
    return subprocess.run([str(python), "-m", "miles_core", *args], capture_output=True, text=True, env=environ,
                          timeout=600)


def test_the_page_holds_the_whole_distribution() -> None:
    assert set(doc_files()) == {"pyproject.toml", "miles_rloo/__init__.py", "miles_rloo/plugin.py"}


def test_rloo_conforms(rloo_venv, monkeypatch) -> None:
    _, source = rloo_venv
    monkeypatch.syspath_prepend(str(source))
    from miles_rloo.plugin import PROBE_LOSS, RLOO

    from miles_core.testing.algorithms import assert_algorithm_conforms

    assert_algorithm_conforms(RLOO(), expected_loss=PROBE_LOSS)
    import torch

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert RLOO().advantages(rewards, 4, None).tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_installed_editable_it_is_listed_and_trains_the_tiny_preset(rloo_venv, tmp_path) -> None:
    python, _ = rloo_venv
    listing = miles(python, "plugins", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    rloo = {p["name"]: p for p in json.loads(listing.stdout)["plugins"]}["miles-rloo"]
    assert (rloo["status"], rloo["distribution"], rloo["contributes"]) == ("ok", "miles-rloo", {"algorithms": ["rloo"]})

    typo = miles(python, "train", "--preset", "tiny", "--set", "algorithm.name=rlo", "--print-config")
    assert typo.returncode == 2 and "did you mean 'rloo'?" in typo.stderr

    proc = miles(python, "train", "--preset", "tiny", "--set", "algorithm.name=rloo", "--out", str(tmp_path / "run"),
                 "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["report"]["algorithm"] == "rloo"
    assert summary["initial_accuracy"] <= 0.2 and summary["final_accuracy"] >= 0.9, summary
