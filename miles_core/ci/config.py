"""The suites file: ``[tool.miles.ci]`` in pyproject.toml, or a TOML file given with ``--config``.

Example::

    [tool.miles.ci]
    paths = ["tests", "plugins/*/tests"]      # where test files live (globs, relative to the root)
    timeout-base = 300                        # per-file timeout floor; the timeout is max(base, 1.25*est_time)

    [tool.miles.ci.labels]
    gpu = "needs a CUDA GPU runner"

    [tool.miles.ci.hardware.cpu]
    install = ["pip install torch==2.13.0", "pip install -r requirements-local.txt"]

    [tool.miles.ci.suites.stage-a-cpu]
    hardware = "cpu"
    runs-on = ["ubuntu-latest"]
    shards = 4

A ``--config`` file holds the same keys either under ``[tool.miles.ci]`` or at its top level.
Every problem is reported with ``file:line`` and the rule it breaks; nothing is partially loaded.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from miles_core.ci.base import CADENCES, HardwareSettings, Suite
from miles_core.errors import ConfigError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
ISSUE_RE = re.compile(r"^(https?://\S+|([\w.-]+/[\w.-]+)?#\d+)$")
CRON_RE = re.compile(r"^(\S+\s+){4}\S+$")

TOP_KEYS = (
    "paths",
    "patterns",
    "timeout-base",
    "nightly-cron",
    "workflows-dir",
    "secrets",
    "default-branch",
    "disabled-needs-issue",
    "labels",
    "hardware",
    "suites",
)
HARDWARE_KEYS = ("install", "image", "python")
SUITE_KEYS = (
    "hardware",
    "runs-on",
    "gpus",
    "host-gpus",
    "shards",
    "cadence",
    "labels",
    "needs",
    "timeout-minutes",
    "disabled",
    "issue",
)
SECRET_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
BRANCH_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


@dataclass(frozen=True)
class CIConfig:
    """The parsed suites file. ``suites`` is None when the file declares none, in which case
    the installed hardware kinds' default suites apply."""

    root: Path
    source: str
    paths: tuple[str, ...] = ("tests",)
    patterns: tuple[str, ...] = ("test_*.py",)
    timeout_base: float = 300.0
    nightly_cron: str = "0 15 * * *"
    workflows_dir: str = ".github/workflows"
    secrets: tuple[str, ...] = ()
    #: the branch whose workflow files are trusted: pushes to it run every stage, and only its
    #: reusable workflows may take self-hosted runners
    default_branch: str = "main"
    #: every disabled registration or stage must name its tracking issue (else: a warning)
    disabled_needs_issue: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    hardware: dict[str, dict[str, Any]] = field(default_factory=dict)
    hardware_sources: dict[str, str] = field(default_factory=dict)
    suites: tuple[Suite, ...] | None = None


def closest(name: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` or a list of the valid names, for error messages."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    if match:
        return f" (did you mean {match[0]!r}?)"
    return f" (known: {', '.join(sorted(candidates)) or 'none'})"


def find_root(start: Path) -> Path:
    """The nearest directory at or above ``start`` whose pyproject.toml has ``[tool.miles.ci]``,
    else the nearest holding any pyproject.toml, else ``start``."""
    projects = [d for d in (start, *start.parents) if (d / "pyproject.toml").is_file()]
    for directory in projects:
        if "[tool.miles.ci" in (directory / "pyproject.toml").read_text(encoding="utf-8"):
            return directory
    return projects[0] if projects else start


def load_config(root: Path, config: Path | None = None) -> CIConfig:
    """Read and validate the suites file of the tree at ``root``."""
    root = root.resolve()
    path = (config if config is not None else root / "pyproject.toml").resolve()
    if not path.is_file():
        raise ConfigError(f"{path}: suites file not found")
    text = path.read_text(encoding="utf-8")
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    prefix: tuple[str, ...] = ("tool", "miles", "ci")
    table = document.get("tool", {}).get("miles", {}).get("ci")
    if table is None:
        if config is None:
            return CIConfig(root=root, source=str(path))
        table, prefix = document, ()
    display = _display(path, root)
    return _Parser(display, text, prefix).parse(root, table)


def _display(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


class _Parser:
    def __init__(self, display: str, text: str, prefix: tuple[str, ...]) -> None:
        self.display = display
        self.lines = text.splitlines()
        self.prefix = prefix
        self.problems: list[str] = []

    # -- locating and reporting -------------------------------------------------------------

    def _line(self, table: tuple[str, ...], key: str | None) -> int | None:
        parts = [*self.prefix, *table]
        header = re.compile(
            r"^\s*\[\s*"
            + r"\s*\.\s*".join(rf"(?:{re.escape(p)}|\"{re.escape(p)}\")" for p in parts)
            + r"\s*\]"
        )
        start = next((i for i, line in enumerate(self.lines) if header.match(line)), None)
        if start is None:
            return None
        if key is None:
            return start + 1
        key_re = re.compile(rf"^\s*(?:{re.escape(key)}|\"{re.escape(key)}\")\s*=")
        for i in range(start + 1, len(self.lines)):
            if self.lines[i].lstrip().startswith("["):
                break
            if key_re.match(self.lines[i]):
                return i + 1
        return start + 1

    def where(self, table: tuple[str, ...], key: str | None) -> str:
        line = self._line(table, key)
        return f"{self.display}:{line}" if line else self.display

    def describe(self, table: tuple[str, ...], key: str | None = None) -> str:
        """``file:line: [table] key``, the prefix of every message about that field."""
        name = ".".join([*self.prefix, *table]) or "top level"
        return f"{self.where(table, key)}: [{name}]" + (f" {key}" if key else "")

    def fail(self, table: tuple[str, ...], key: str | None, message: str) -> None:
        self.problems.append(f"{self.describe(table, key)}: {message}")

    # -- typed getters (each records a problem and returns the default on bad input) --------

    def _table(self, data: dict[str, Any], key: str, table: tuple[str, ...]) -> dict[str, Any]:
        value = data.get(key, {})
        if not isinstance(value, dict):
            self.fail(table, key, f"must be a table, got {type(value).__name__}")
            return {}
        return value

    def _strings(
        self, data: dict[str, Any], key: str, table: tuple[str, ...], default: tuple[str, ...]
    ) -> tuple[str, ...]:
        if key not in data:
            return default
        value = data[key]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.fail(table, key, f"must be a list of non-empty strings, got {value!r}")
            return default
        if len(set(value)) != len(value):
            self.fail(table, key, f"has duplicate entries {sorted({v for v in value if value.count(v) > 1})}")
        return tuple(value)

    def _int(
        self, data: dict[str, Any], key: str, table: tuple[str, ...], default: int | None, minimum: int
    ) -> int | None:
        if key not in data:
            return default
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(table, key, f"must be an integer >= {minimum}, got {value!r}")
            return default
        return value

    def _str(self, data: dict[str, Any], key: str, table: tuple[str, ...], default: str | None) -> str | None:
        if key not in data:
            return default
        value = data[key]
        if not isinstance(value, str) or not value.strip():
            self.fail(table, key, f"must be a non-empty string, got {value!r}")
            return default
        return value

    def _unknown_keys(self, data: dict[str, Any], known: Sequence[str], table: tuple[str, ...]) -> None:
        for key in data:
            if key not in known:
                self.fail(table, key, "unknown key" + closest(key, known))

    # -- the document -----------------------------------------------------------------------

    def parse(self, root: Path, data: dict[str, Any]) -> CIConfig:
        self._unknown_keys(data, TOP_KEYS, ())
        labels = self._labels(data)
        hardware = {
            name: self._hardware(name, value) for name, value in self._table(data, "hardware", ()).items()
        }
        suites_table = self._table(data, "suites", ())
        suites = (
            tuple(self._suite(name, value) for name, value in suites_table.items()) if suites_table else None
        )
        timeout = data.get("timeout-base", 300)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            self.fail((), "timeout-base", f"must be a positive number of seconds, got {timeout!r}")
            timeout = 300
        cron = self._str(data, "nightly-cron", (), "0 15 * * *")
        if cron is not None and not CRON_RE.match(cron.strip()):
            self.fail((), "nightly-cron", f"must be a 5-field cron expression, got {cron!r}")
        config = CIConfig(
            root=root,
            source=self.display,
            paths=self._strings(data, "paths", (), ("tests",)),
            patterns=self._strings(data, "patterns", (), ("test_*.py",)),
            timeout_base=float(timeout),
            nightly_cron=cron or "0 15 * * *",
            workflows_dir=self._str(data, "workflows-dir", (), ".github/workflows") or ".github/workflows",
            secrets=self._secrets(data),
            default_branch=self._branch(data),
            disabled_needs_issue=self._bool(data, "disabled-needs-issue", (), False),
            labels=labels,
            hardware=hardware,
            hardware_sources={name: self.describe(("hardware", name)) for name in hardware},
            suites=suites,
        )
        if self.problems:
            raise ConfigError(joined(self.problems))
        return config

    def _bool(self, data: dict[str, Any], key: str, table: tuple[str, ...], default: bool) -> bool:
        value = data.get(key, default)
        if not isinstance(value, bool):
            self.fail(table, key, f"must be true or false, got {value!r}")
            return default
        return value

    def _branch(self, data: dict[str, Any]) -> str:
        branch = self._str(data, "default-branch", (), "main") or "main"
        if not BRANCH_RE.match(branch):
            self.fail((), "default-branch", f"must be a branch name like 'main', got {branch!r}")
        return branch

    def _secrets(self, data: dict[str, Any]) -> tuple[str, ...]:
        secrets = self._strings(data, "secrets", (), ())
        bad = [name for name in secrets if not SECRET_RE.match(name) or name.startswith("GITHUB_")]
        if bad:
            self.fail((), "secrets", f"secret names are UPPER_SNAKE_CASE and not GITHUB_*, got {bad}")
        return secrets

    def _labels(self, data: dict[str, Any]) -> dict[str, str]:
        labels: dict[str, str] = {}
        for name, description in self._table(data, "labels", ()).items():
            if not NAME_RE.match(name):
                self.fail(("labels",), name, "label names are lowercase letters, digits and '-'")
            elif name == "all":
                self.fail(("labels",), name, "'all' is reserved (it selects every label)")
            elif not isinstance(description, str) or not description.strip():
                self.fail(("labels",), name, f"must be a non-empty description string, got {description!r}")
            else:
                labels[name] = description
        return labels

    def _hardware(self, name: str, data: Any) -> dict[str, Any]:
        table = ("hardware", name)
        if not isinstance(data, dict):
            self.fail(("hardware",), name, f"must be a table, got {type(data).__name__}")
            return {}
        self._unknown_keys(data, HARDWARE_KEYS, table)
        out: dict[str, Any] = {}
        if "install" in data:
            out["install"] = self._strings(data, "install", table, ())
        for key in ("image", "python"):
            if key in data:
                out[key] = self._str(data, key, table, None)
        return out

    def _suite(self, name: str, data: Any) -> Suite:
        table = ("suites", name)
        if not NAME_RE.match(name):
            self.fail(table, None, "suite names are lowercase letters, digits and '-' (they become job ids)")
        if not isinstance(data, dict):
            self.fail(("suites",), name, f"must be a table, got {type(data).__name__}")
            data = {}
        self._unknown_keys(data, SUITE_KEYS, table)
        hardware = self._str(data, "hardware", table, None)
        if hardware is None and "hardware" not in data:
            self.fail(table, None, "missing required key 'hardware'")
        runs_on = self._strings(data, "runs-on", table, ())
        if "runs-on" not in data:
            self.fail(table, None, "missing required key 'runs-on' (the runner labels)")
        cadence = self._strings(data, "cadence", table, CADENCES)
        for value in cadence:
            if value not in CADENCES:
                self.fail(table, "cadence", f"unknown cadence {value!r}" + closest(value, CADENCES))
        if not cadence:
            self.fail(table, "cadence", "must name at least one cadence")
        disabled = self._str(data, "disabled", table, None)
        issue = self._str(data, "issue", table, None)
        if issue is not None:
            if disabled is None:
                self.fail(table, "issue", 'a tracking issue is only meaningful with disabled = "reason"')
            elif not ISSUE_RE.match(issue):
                self.fail(
                    table, "issue", f"must be a URL or an issue reference like owner/repo#12, got {issue!r}"
                )
        return Suite(
            name=name,
            hardware=hardware or "",
            runs_on=runs_on,
            gpus=self._int(data, "gpus", table, 0, 0) or 0,
            host_gpus=self._int(data, "host-gpus", table, None, 1),
            shards=self._int(data, "shards", table, 1, 1) or 1,
            cadence=cadence,
            labels=self._strings(data, "labels", table, ()),
            needs=self._strings(data, "needs", table, ()),
            timeout_minutes=self._int(data, "timeout-minutes", table, 60, 1) or 60,
            disabled=disabled,
            issue=issue,
            source=self.where(table, None),
        )


def joined(problems: list[str]) -> str:
    """One error message listing every problem."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n  " + "\n  ".join(problems)


def settings_for(config: CIConfig, default: HardwareSettings, hardware: str) -> HardwareSettings:
    """The project's settings for ``hardware``, falling back to the kind's defaults per key."""
    return replace(default, **config.hardware.get(hardware, {}))
