"""Fixtures for the CI concern's tests: throwaway trees with a suites file, the CLI, and a
the workflow linters (GitHub Actions itself is modelled in actions_sim.py)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from miles_core.ci.catalog import Catalog, load_catalog
from miles_core.plugins import MilesPluginManager

SUITES = """
[tool.miles.ci]
paths = ["tests"]
timeout-base = 30

[tool.miles.ci.labels]
gpu = "needs a GPU"
slow = "slow"

[tool.miles.ci.suites.unit]
hardware = "cpu"
runs-on = ["ubuntu-latest"]
shards = 2

[tool.miles.ci.suites.integration]
hardware = "cpu"
runs-on = ["ubuntu-latest"]

[tool.miles.ci.suites.gpu-1]
hardware = "cuda"
runs-on = ["self-hosted", "h200", "1gpu"]
gpus = 1
labels = ["gpu"]
needs = ["unit"]

[tool.miles.ci.suites.gpu-4]
hardware = "cuda"
runs-on = ["self-hosted", "h200", "4gpu"]
gpus = 4
host-gpus = 8
shards = 2
labels = ["gpu"]

[tool.miles.ci.suites.gpu-old]
hardware = "cuda"
runs-on = ["self-hosted", "a100", "4gpu"]
gpus = 4
labels = ["gpu"]
disabled = "A100 runners were retired"
issue = "https://github.com/example/project/issues/7"
"""

HEADER = "from miles_core.ci.register import register_cpu_ci, register_cuda_ci\n\n"


@dataclass
class Tree:
    """A project tree in a temporary directory, loaded with an isolated plugin manager."""

    root: Path
    pm: MilesPluginManager

    def write(self, rel: str, text: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    def test_file(self, rel: str, registration: str, body: str = "def test_ok():\n    pass\n") -> Path:
        return self.write(
            rel, HEADER + textwrap.dedent(registration).strip() + "\n\n\n" + textwrap.dedent(body)
        )

    def catalog(self, config: Path | None = None) -> Catalog:
        return load_catalog(self.root, config, pm=self.pm)


@pytest.fixture
def ci_pm(miles_pm_factory: Callable[..., MilesPluginManager]) -> MilesPluginManager:
    """An isolated manager with the core's built-ins (core-ci: cpu and cuda) only."""
    return miles_pm_factory(builtins=True)


@pytest.fixture
def tree(tmp_path: Path, ci_pm: MilesPluginManager) -> Tree:
    root = tmp_path / "project"
    root.mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "demo"\n' + SUITES, encoding="utf-8")
    return Tree(root, ci_pm)


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def cli(capfd: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run ``miles`` in-process with the isolated manager; returns exit code, stdout, stderr."""
    from miles_core.cli import main

    def run(*args: str) -> CliResult:
        capfd.readouterr()
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        else:  # pragma: no cover - main always exits
            code = 0
        out, err = capfd.readouterr()
        return CliResult(code, out, err)

    return run


# -- workflow linters -----------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    import shutil
    import sys

    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed; install the dev extra (pip install -e '.[dev]')")
    return found


@pytest.fixture
def lint_workflows() -> Callable[[Path], list[str]]:
    """Run actionlint and zizmor (offline, with the repository's zizmor.yml) on a workflows
    directory inside a git repository; return their complaints (empty when both pass)."""
    import subprocess

    def lint(workflows: Path, persona: str = "regular") -> list[str]:
        repo = workflows.parent.parent
        if not (repo / ".git").exists():
            subprocess.run(["git", "init", "-q", str(repo)], check=True)
        complaints = []
        actionlint = subprocess.run(
            [_tool("actionlint"), "-no-color"], cwd=repo, capture_output=True, text=True
        )
        if actionlint.returncode != 0:
            complaints.append(f"actionlint: {actionlint.stdout}{actionlint.stderr}")
        zizmor = subprocess.run(
            [
                _tool("zizmor"),
                "--offline",
                "--no-progress",
                "--persona",
                persona,
                "--config",
                str(REPO_ROOT / ".github" / "zizmor.yml"),
                str(workflows),
            ],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "HOME": str(repo)},  # no GitHub token: nothing online
        )
        if zizmor.returncode != 0:
            complaints.append(f"zizmor: {zizmor.stdout}{zizmor.stderr}")
        return complaints

    return lint
