"""Sessions: lint, tests (everything installed), one per plugin (core + that plugin only), packaging.

``nox`` with no arguments runs them all; that is the README's test command and what CI runs.
torch is always installed first, pinned to the CPU build on disk: an unpinned torch would pull a
multi-GB CUDA build.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests", "plugin", "packaging"]
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"
PLUGINS = ["miles_rocm", "miles_e2b", "miles_qwen35", "miles_mtp"]
#: a plugin's own optional extra its tests exercise (the rocm checkpoint guard protects megatron-core)
PLUGIN_TEST_EXTRAS = {"miles_rocm": "[megatron]"}
ALL_LOCAL = ["-e", ".[dev,engine,megatron]", *[arg for p in PLUGINS for arg in ("-e", f"plugins/{p}")]]


def _version(init_file: Path) -> str:
    for line in init_file.read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise ValueError(f"no __version__ in {init_file}")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, then mypy on miles_core and the plugins (``[tool.mypy]`` in pyproject.toml) against the
    real dependencies, so everything is installed (torch first). mypy's incremental cache lives in
    a temporary directory of this run: a cache left by another checkout never decides a result."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.install(TORCH)
    session.install(*ALL_LOCAL)
    with tempfile.TemporaryDirectory(prefix="miles-mypy-") as cache:
        session.run("mypy", "--cache-dir", cache, *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU suites, run through `miles ci run`, with every distribution of the repository installed.

    The committed workflows must match what `miles ci workflows` generates from the suites.
    Extra arguments are passed to `miles ci run` (e.g. `nox -s tests -- --partition 1/2`).
    """
    session.install(TORCH)
    session.install(*ALL_LOCAL)
    session.run("miles", "ci", "workflows", "--check")
    if session.posargs:
        for suite in ("stage-a-cpu", "stage-b-cpu"):
            session.run("miles", "ci", "run", "--hw", "cpu", "--suite", suite, *session.posargs)
        return
    # CI's machine has 2 cores and the tests run one torch thread each: the two stage-a shards run
    # side by side (as on two runners), then stage-b.
    _run_side_by_side(session, [["miles", "ci", "run", "--hw", "cpu", "--suite", "stage-a-cpu", "--partition", f"{i}/2"]
                                for i in range(2)])
    session.run("miles", "ci", "run", "--hw", "cpu", "--suite", "stage-b-cpu")


def _run_side_by_side(session: nox.Session, commands: list[list[str]]) -> None:
    """Run ``commands`` at once in the session's venv; print each one's output when all are done."""
    env = {**os.environ, "PATH": f"{session.bin}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": session.virtualenv.location}
    with tempfile.TemporaryDirectory(prefix="miles-nox-") as tmp:
        logs = [Path(tmp) / f"{i}.log" for i in range(len(commands))]
        procs = []
        for command, log in zip(commands, logs):
            session.log(" ".join(command) + f"  (output: after all {len(commands)} finish)")
            with log.open("wb") as out:
                procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
        codes = [proc.wait() for proc in procs]
        for command, log, code in zip(commands, logs, codes):
            print(f"----- {' '.join(command)}: exit {code} -----\n{log.read_text(errors='replace')}", flush=True)
    failed = [" ".join(c) for c, code in zip(commands, codes) if code]
    if failed:
        session.error(f"failed: {'; '.join(failed)}")


@nox.session
@nox.parametrize("name", PLUGINS)
def plugin(session: nox.Session, name: str) -> None:
    """One plugin's tests with only the core and that plugin (and its declared deps) installed."""
    session.install(TORCH)
    session.install("-e", ".[dev]", "-e", f"plugins/{name}{PLUGIN_TEST_EXTRAS.get(name, '')}")
    session.run("pytest", f"plugins/{name}/tests", *session.posargs)


@nox.session
def packaging(session: nox.Session) -> None:
    """Build every wheel, install ``miles[rocm,e2b]`` from them into a fresh venv, check the plugins;
    then ``miles[train]`` runs the main job there, and ``miles`` alone stays small and says what it lacks."""
    session.install("build>=1.2")
    with tempfile.TemporaryDirectory(prefix="miles-packaging-") as tmp:
        wheels = Path(tmp) / "wheels"
        for source in [ROOT, *(ROOT / "plugins" / p for p in PLUGINS)]:
            session.run("python", "-m", "build", "--wheel", "--outdir", str(wheels), str(source), silent=True)
        built = sorted(p.name for p in wheels.glob("*.whl"))
        session.log(f"built {built}")
        if len(built) != 1 + len(PLUGINS):
            session.error(f"expected {1 + len(PLUGINS)} wheels, built {built}")

        venv = Path(tmp) / "venv"
        session.run("python", "-m", "venv", str(venv))
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        session.run(*pip, TORCH, external=True)
        session.run(*pip, "--find-links", str(wheels), "miles[rocm,e2b]", external=True)
        out = session.run(
            str(venv / "bin" / "miles"), "plugins", "list", "--json", external=True, silent=True
        )
        plugins = {p["name"]: p for p in json.loads(out)["plugins"]}
        third_party = {n: (p["version"], p["status"]) for n, p in plugins.items() if not p["builtin"]}
        expected = {
            f"miles-{short}": (
                _version(ROOT / "plugins" / f"miles_{short}" / f"miles_{short}" / "__init__.py"),
                "ok",
            )
            for short in ("rocm", "e2b")
        }
        if third_party != expected:
            session.error(f"miles plugins list shows {third_party}, expected exactly {expected}")
        broken = [n for n, p in plugins.items() if p["status"] != "ok"]
        if broken:
            session.error(f"plugins not ok after install: {broken}")
        session.log(f"installed plugins verified: {third_party}")
        _check_train_extra(session, venv, wheels, Path(tmp))
        _check_core_alone(session, wheels, Path(tmp) / "core-venv")


def _check_train_extra(session: nox.Session, venv: Path, wheels: Path, tmp: Path) -> None:
    """``pip install "miles[train]"`` (torch already there) runs the README's main job twice in a row
    in one directory, as a newcomer repeating it would: each run gets its own run directory and
    ``runs/tiny/latest`` points at the second."""
    session.run(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--find-links", str(wheels),
                "miles[train]", external=True)
    work = tmp / "main-job"
    work.mkdir()
    with session.chdir(work):
        for _ in range(2):
            session.run(str(venv / "bin" / "miles"), "train", "--preset", "tiny", "--set", "run.steps=2",
                        "--no-progress", external=True, env={"MILES_CACHE_DIR": str(tmp / "cache")})
    runs = work / "runs" / "tiny"
    made = sorted(p for p in runs.iterdir() if p.is_dir() and not p.is_symlink())
    if len(made) != 2 or (runs / "latest").resolve() != made[-1].resolve():
        session.error(f"two runs of the main job should leave two run directories and latest -> the second; "
                      f"found {[p.name for p in runs.iterdir()]}")
    session.log(f"main job twice: {[p.name for p in made]}, latest -> {made[-1].name}")


#: what `pip install miles` may add to a fresh venv's site-packages (README: the core stays small)
CORE_SITE_PACKAGES_MB = 30


def _check_core_alone(session: nox.Session, wheels: Path, venv: Path) -> None:
    """``pip install miles`` alone: small, lists its plugins, and ``miles train`` names what it lacks."""
    session.run("python", "-m", "venv", str(venv))
    python = str(venv / "bin" / "python")
    site = Path(session.run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                            external=True, silent=True).strip())
    before = _tree_bytes(site)
    session.run(python, "-m", "pip", "install", "-q", "--find-links", str(wheels), "miles", external=True)
    added_mb = (_tree_bytes(site) - before) / 2**20
    if added_mb > CORE_SITE_PACKAGES_MB:
        session.error(f"pip install miles added {added_mb:.1f} MB to site-packages (limit {CORE_SITE_PACKAGES_MB})")
    listing = json.loads(session.run(str(venv / "bin" / "miles"), "plugins", "list", "--json",
                                     external=True, silent=True))
    not_ok = [p["name"] for p in listing["plugins"] if p["status"] != "ok"]
    if not_ok:
        session.error(f"core-only install: plugins not ok: {not_ok}")
    proc = subprocess.run([str(venv / "bin" / "miles"), "train", "--preset", "tiny"], capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    if proc.returncode != 2 or len(lines) != 1 or "pip install" not in lines[0]:
        session.error(f"core-only `miles train` should fail in one line naming what to install; "
                      f"exit {proc.returncode}, stderr:\n{proc.stderr[-2000:]}")
    session.log(f"core alone: {added_mb:.1f} MB, plugins ok, `miles train`: {lines[0]}")


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
