"""Real distributions for the core's tests: fixture plugins (tests/fixtures/plugins/<name>) built as
wheels and installed into a temporary venv.

The venv sees this environment's packages (miles and its dependencies) through a ``.pth`` file,
so nothing is downloaded; the fixture plugins are discovered only through their entry points.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent.parent / "fixtures" / "plugins"

Miles = Callable[..., subprocess.CompletedProcess[str]]


def _build_venv(root: Path, fixtures: tuple[str, ...]) -> Path:
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
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels),
         *(str(FIXTURES / name) for name in fixtures)],
        check=True,
    )
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(purelib),
         *map(str, sorted(wheels.glob("*.whl")))],
        check=True,
    )
    return python


@pytest.fixture(scope="session")
def plugin_venv(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``plugin_venv("good", "broken")``: the python of a venv with those fixture distributions
    installed (built once per session for each set)."""
    built: dict[tuple[str, ...], Path] = {}

    def make(*fixtures: str) -> Path:
        # the fixture distributions build offline with this environment's hatchling (the dev extra)
        pytest.importorskip("hatchling", reason="building the fixture plugins needs hatchling (miles[dev])")
        key = tuple(sorted(fixtures))
        if key not in built:
            built[key] = _build_venv(tmp_path_factory.mktemp("plugin-venv"), key)
        return built[key]

    return make


def run_miles(python: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m miles_core ARGS`` with no inherited ``MILES_*`` variable except ``env``'s
    (the entry-point cache stays: a fresh venv has its own key)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")} | env
    return subprocess.run(
        [str(python), "-m", "miles_core", *args], capture_output=True, text=True, env=environ, timeout=120
    )


@pytest.fixture(scope="session")
def miles() -> Miles:
    return run_miles
