"""Sessions: lint, one per plugin (core + that plugin only), packaging, and the CPU suites with every
distribution installed, in two shard sessions.

``nox`` with no arguments runs them all, as many at once as the machine has cores (CI: two); that is
the README's test command and what CI runs. The short sessions come first, so on two cores they share
both before the two shard sessions (most of the time) start side by side.

Installs go through uv when nox has it (``pip install 'nox[uv]'``), told pip's own configuration
(indexes, find-links, constraints); otherwise through pip. torch is always installed first, pinned
to the CPU build on disk: an unpinned torch would pull a multi-GB CUDA build.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

nox.needs_version = ">=2026.10.20"  # sessions in parallel (nox.options.parallel)
nox.options.sessions = ["lint", "packaging", "plugin", "tests"]  # the short ones first, longest first
nox.options.error_on_missing_interpreters = True
nox.options.parallel = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
nox.options.allow_parallel = True

# Every test file runs in a fresh pytest process: without bytecode, each one recompiles miles and its
# tests and pytest re-rewrites hypothesis (a third of a small file's time). Bytecode goes to the
# gitignored __pycache__ folders and the session venvs.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"
PLUGINS = ["miles_rocm", "miles_e2b", "miles_qwen35", "miles_mtp"]
#: a plugin's own optional extra its tests exercise (the rocm checkpoint guard protects megatron-core)
PLUGIN_TEST_EXTRAS = {"miles_rocm": "[megatron]"}
ALL_LOCAL = ["-e", ".[dev,engine,megatron]", *[arg for p in PLUGINS for arg in ("-e", f"plugins/{p}")]]
#: the CPU suites, each planned in TEST_SHARDS shards (their `shards` in [tool.miles.ci.suites]);
#: session tests(shard=i) runs shard i of each
CPU_SUITES = ("stage-a-cpu", "stage-b-cpu")
TEST_SHARDS = 2

#: pip settings and the uv variables that say the same (lists: pip splits on whitespace)
_PIP_TO_UV = {"index-url": ("UV_DEFAULT_INDEX", " "), "extra-index-url": ("UV_INDEX", " "),
              "find-links": ("UV_FIND_LINKS", ","), "constraint": ("UV_CONSTRAINT", " "),
              "cert": ("SSL_CERT_FILE", " "), "timeout": ("UV_HTTP_TIMEOUT", " "),
              "default-timeout": ("UV_HTTP_TIMEOUT", " ")}
#: pip settings about its output, prompts and cache: they do not change what gets installed
_PIP_COSMETIC = {"disable-pip-version-check", "no-input", "quiet", "verbose", "progress-bar", "no-color",
                 "root-user-action", "no-warn-script-location", "cache-dir", "no-cache-dir", "retries"}


def _uv_environment_from_pip() -> dict[str, str] | None:
    """pip's effective configuration (its files and PIP_* variables) as uv's variables, or None when
    it sets something without a translation here (then pip does the installs).

    ``unsafe-best-match`` is pip's rule: the best version across every index and find-links location.
    """
    try:
        listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                                 text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rank = {"global": 0, "install": 1, ":env:": 2}  # pip: variables over [install] over [global]
    settings: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, _, raw = line.partition("=")
        section, _, key = name.rpartition(".")
        if section in rank and (key not in settings or rank[section] >= settings[key][0]):
            settings[key] = (rank[section], ast.literal_eval(raw))
    env = {"UV_INDEX_STRATEGY": "unsafe-best-match"}
    for key, (_, value) in sorted(settings.items()):
        if key in _PIP_TO_UV:
            variable, separator = _PIP_TO_UV[key]
            env[variable] = separator.join(value.split())
        elif key not in _PIP_COSMETIC:
            return None
    return env


_UV_ENVIRONMENT = _uv_environment_from_pip()
if _UV_ENVIRONMENT is None:
    nox.options.default_venv_backend = "virtualenv"
else:
    nox.options.default_venv_backend = "uv|virtualenv"
    for _variable, _value in _UV_ENVIRONMENT.items():
        os.environ.setdefault(_variable, _value)


def _install_torch(session: nox.Session, python: Path | None = None) -> None:
    """The pinned CPU torch into the session's venv (or ``python``'s); under uv its resolution is
    checked first, so no CUDA build is ever fetched."""
    if session.venv_backend != "uv":
        if python is None:
            session.install(TORCH)
        else:
            session.run(str(python), "-m", "pip", "install", "-q", TORCH, external=True)
        return
    target = [] if python is None else ["--python", str(python)]
    plan = session.run("uv", "pip", "install", *target, "--dry-run", TORCH, silent=True)
    cuda = [line.strip() for line in str(plan).splitlines()
            if line.strip().startswith(("+ nvidia-", "+ triton")) or "+cu" in line]
    if cuda:
        session.error(f"{TORCH} resolves to a CUDA build here ({', '.join(cuda)}): put the CPU wheel "
                      "where pip finds it (find-links or an index in pip's configuration)")
    if python is None:
        session.install(TORCH)
    else:
        session.run("uv", "pip", "install", *target, TORCH)


def _version(init_file: Path) -> str:
    for line in init_file.read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise ValueError(f"no __version__ in {init_file}")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, then mypy on miles_core, the plugins and the benchmarks (``[tool.mypy]`` in pyproject.toml) against the
    real dependencies, so everything is installed (torch first). mypy's incremental cache lives in
    a temporary directory of this run: a cache left by another checkout never decides a result."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.install(TORCH)
    session.install(*ALL_LOCAL)
    with tempfile.TemporaryDirectory(prefix="miles-mypy-") as cache:
        session.run("mypy", "--cache-dir", cache, *session.posargs)


@nox.session
@nox.parametrize("shard", list(range(TEST_SHARDS)))
def tests(session: nox.Session, shard: int) -> None:
    """Shard ``shard`` of each CPU suite through `miles ci run`, every distribution installed.

    Shard 0 also checks that the committed workflows match what `miles ci workflows` generates from
    the suites. Each suite's JUnit report is left in the session's venv folder, for `miles ci
    est-times --from .nox/tests-*/junit-*.xml`. Extra arguments go to `miles ci run` (e.g. `nox -s
    tests -- --fail-fast`).
    """
    _install_torch(session)
    session.install(*ALL_LOCAL)
    if session.venv_backend == "uv":
        session.install("pip")  # tests install throwaway plugins with `python -m pip`
    if shard == 0:
        session.run("miles", "ci", "workflows", "--check")
    failed = []
    for suite in CPU_SUITES:  # a failure in one suite still runs the next
        try:
            junit = Path(session.virtualenv.location) / f"junit-{suite}.xml"
            session.run("miles", "ci", "run", "--hw", "cpu", "--suite", suite, "--partition",
                        f"{shard}/{TEST_SHARDS}", "--junit", str(junit), *session.posargs)
        except nox.command.CommandFailed:
            failed.append(suite)
    if failed:
        session.error(f"failed: {', '.join(failed)} (shard {shard}/{TEST_SHARDS})")


@nox.session
@nox.parametrize("name", PLUGINS)
def plugin(session: nox.Session, name: str) -> None:
    """One plugin's tests with only the core and that plugin (and its declared deps) installed."""
    _install_torch(session)
    session.install("-e", ".[dev]", "-e", f"plugins/{name}{PLUGIN_TEST_EXTRAS.get(name, '')}")
    session.run("pytest", f"plugins/{name}/tests", *session.posargs)


@nox.session
def packaging(session: nox.Session) -> None:
    """Build every wheel, install ``miles[rocm,e2b]`` from them into a fresh venv, check the plugins;
    then ``miles[train]`` runs the main job there, and ``miles`` alone stays small and says what it lacks.

    miles is installed with pip, as the README says; torch, its prerequisite, and the build tool go
    through uv when nox has it (same backend, hatchling; uv keeps the build environment)."""
    if session.venv_backend == "uv":
        build = ["uv", "build", "--wheel", "--out-dir"]
    else:
        session.install("build>=1.2")
        build = ["python", "-m", "build", "--wheel", "--outdir"]
    with tempfile.TemporaryDirectory(prefix="miles-packaging-") as tmp:
        wheels = Path(tmp) / "wheels"
        for source in [ROOT, *(ROOT / "plugins" / p for p in PLUGINS)]:
            session.run(*build, str(wheels), str(source), silent=True)
        built = sorted(p.name for p in wheels.glob("*.whl"))
        session.log(f"built {built}")
        if len(built) != 1 + len(PLUGINS):
            session.error(f"expected {1 + len(PLUGINS)} wheels, built {built}")

        venv = Path(tmp) / "venv"
        session.run("python", "-m", "venv", str(venv))
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        _install_torch(session, python=venv / "bin" / "python")
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

