"""Find test files and the registration marker calls in them, by parsing source.

Test files are never imported, but each is compiled, so a syntax error anywhere in it is reported
here rather than on a runner. A registration is a module-level expression statement calling a
marker (``register_cpu_ci(...)`` or ``module.register_cpu_ci(...)``) with literal arguments. Every
way of writing one that the parser would not see -- a call inside ``if``/``def``, an import
alias, a marker passed around as a value -- is an error, as is a test file with no registration.
Problems are reported as ``file:line: message``.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from miles_core.ci.base import POSITIONAL_PARAMETERS
from miles_core.ci.config import ISSUE_RE, closest

#: module-level constant a multi-GPU test uses for its GPU count (``NUM_GPUS = 8``)
GPU_COUNT_NAME = "NUM_GPUS"
#: how many lines past its opening line a registration call may span before the parser falls
#: back to parsing the whole file
_MAX_STATEMENT_LINES = 40


@dataclass(frozen=True)
class Registration:
    """One marker call in a test file. ``est_span`` locates the ``est_time`` literal
    (line, column, end line, end column; 1-based lines, 0-based columns) for rewriting."""

    path: str
    line: int
    hardware: str
    marker: str
    est_time: float
    suite: str
    labels: tuple[str, ...] = ()
    nightly: bool = False
    disabled: str | None = None
    issue: str | None = None
    num_gpus: int | None = None
    layout: Mapping[str, int] | None = None
    #: ``NUM_GPUS = <int>`` at module level of the file, with its line
    declared_gpus: tuple[int, int] | None = None
    est_span: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def enabled(self) -> bool:
        return self.disabled is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "line": self.line,
            "hardware": self.hardware,
            "suite": self.suite,
            "est_time": self.est_time,
            "labels": list(self.labels),
            "nightly": self.nightly,
            "disabled": self.disabled,
            "issue": self.issue,
            "num_gpus": self.num_gpus,
            "layout": dict(self.layout) if self.layout is not None else None,
        }


@dataclass(frozen=True)
class Marker:
    """A marker function the parser recognises: its name, hardware and accepted parameters."""

    name: str
    hardware: str
    parameters: tuple[str, ...]


def find_test_files(root: Path, paths: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """Test files under the ``paths`` globs matching ``patterns``, as sorted root-relative paths."""
    found: set[str] = set()
    for path_glob in paths:
        for directory in sorted(root.glob(path_glob)):
            if not directory.is_dir():
                continue
            for pattern in patterns:
                for file in directory.rglob(pattern):
                    rel = file.relative_to(root)
                    if file.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                        found.add(rel.as_posix())
    return sorted(found)


def discover(
    root: Path, files: Iterable[str], markers: Mapping[str, Marker]
) -> tuple[list[Registration], list[str]]:
    """Parse ``files`` (root-relative) and return their registrations and every problem found."""
    registrations: list[Registration] = []
    problems: list[str] = []
    for rel in files:
        text = (root / rel).read_text(encoding="utf-8")
        found, file_problems = parse_source(text, rel, markers)
        registrations.extend(found)
        problems.extend(file_problems)
    return registrations, problems


def parse_source(text: str, path: str, markers: Mapping[str, Marker]) -> tuple[list[Registration], list[str]]:
    """Registrations in one file's source, and its problems."""
    hint = f"add a module-level call to one of {', '.join(sorted(markers))} (est_time=..., suite=...)"
    if not any(name in text for name in markers):
        return [], [f"{path}:1: no CI registration: {hint}"]
    try:
        # compiling (not only parsing) also rejects what the parser accepts ('return' outside a
        # function, 'nonlocal' at module level, ...): the file would not run on the runner either
        compile(text, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte in the source
        line = getattr(exc, "lineno", None) or 1
        return [], [f"{path}:{line}: cannot compile: {getattr(exc, 'msg', exc)}"]
    tree = _registration_prefix(text, markers) or ast.parse(text, filename=path)
    parser = _FileParser(path, markers)
    parser.visit_module(tree)
    if not parser.registrations and not parser.problems:
        parser.problems.append(f"{path}:1: no CI registration: {hint}")
    return parser.registrations, parser.problems


def _registration_prefix(text: str, markers: Mapping[str, Marker]) -> ast.Module | None:
    """The AST of the file's opening statements when they hold every mention of a marker and
    the file's ``NUM_GPUS = ...`` lines.

    Registrations sit near the top, so parsing up to the end of the last column-0 call (or GPU
    count) is enough -- and much cheaper than parsing the whole file -- when the rest never names
    a marker. A prefix that parses as a module ends between top-level statements (no string or
    bracket left open), so its statements are exactly the file's first ones. Returns None when
    the whole file must be parsed.
    """
    names = "|".join(re.escape(name) for name in markers)
    pattern = rf"^(?:(?:[A-Za-z_][\w.]*\.)?(?:{names})\s*\(|{GPU_COUNT_NAME}\b)"
    matches = list(re.finditer(pattern, text, re.MULTILINE))
    if not matches:
        return None
    last = matches[-1]
    end = last.end()
    for _ in range(_MAX_STATEMENT_LINES):
        newline = text.find("\n", end)
        end = len(text) if newline < 0 else newline + 1
        if any(name in text[end:] for name in markers):
            return None
        try:
            return ast.parse(text[:end])
        except SyntaxError:
            if end == len(text):
                return None
    return None


def _declared_gpus(tree: ast.Module) -> tuple[int, int] | None:
    """(count, line) of a module-level ``NUM_GPUS = <int>`` (the last one), or None."""
    found = None
    for stmt in tree.body:
        target, value = None, None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.AnnAssign):
            target, value = stmt.target, stmt.value
        if (
            isinstance(target, ast.Name)
            and target.id == GPU_COUNT_NAME
            and isinstance(value, ast.Constant)
            and _is_int(value.value)
        ):
            found = (value.value, stmt.lineno)
    return found


def _callee(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


class _FileParser:
    def __init__(self, path: str, markers: Mapping[str, Marker]) -> None:
        self.path = path
        self.markers = markers
        self.registrations: list[Registration] = []
        self.problems: list[str] = []
        self.declared_gpus: tuple[int, int] | None = None

    def fail(self, node: ast.AST, message: str) -> None:
        self.problems.append(f"{self.path}:{getattr(node, 'lineno', 1)}: {message}")

    def visit_module(self, tree: ast.Module) -> None:
        accepted: set[int] = set()
        self.declared_gpus = _declared_gpus(tree)
        for stmt in tree.body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                name = _callee(stmt.value.func)
                if name is not None and name in self.markers:
                    accepted.add(id(stmt.value.func))
                    self.registration(stmt.value, self.markers[name])
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import):
                for alias in node.names:
                    leaf = alias.name.rpartition(".")[2]
                    if leaf in self.markers and alias.asname not in (None, leaf):
                        self.fail(
                            node,
                            f"{leaf} is imported as {alias.asname!r}; miles ci finds markers by name, import it unaliased",
                        )
            elif (
                isinstance(node, ast.Call)
                and _callee(node.func) in self.markers
                and id(node.func) not in accepted
            ):
                self.fail(
                    node,
                    f"{_callee(node.func)}(...) must be a module-level statement; inside a function, class, if or with block it is never discovered",
                )
                accepted.add(id(node.func))
            elif (
                isinstance(node, ast.Name | ast.Attribute)
                and _callee(node) in self.markers
                and id(node) not in accepted
            ):
                self.fail(
                    node,
                    f"{_callee(node)} is referenced without being called; call it directly at module level",
                )
        seen: dict[tuple[str, str], int] = {}
        for reg in self.registrations:
            key = (reg.hardware, reg.suite)
            if key in seen:
                self.problems.append(
                    f"{reg.location}: duplicate registration for {reg.hardware} suite {reg.suite!r} (first at line {seen[key]})"
                )
            seen.setdefault(key, reg.line)

    def registration(self, call: ast.Call, marker: Marker) -> None:
        before = len(self.problems)
        values: dict[str, Any] = {}
        nodes: dict[str, ast.expr] = {}
        for index, arg in enumerate(call.args):
            if isinstance(arg, ast.Starred):
                self.fail(arg, f"{marker.name}: *args is not allowed; pass literals by keyword")
                continue
            if index >= len(POSITIONAL_PARAMETERS):
                self.fail(
                    arg, f"{marker.name}: only est_time and suite may be positional; pass the rest by keyword"
                )
                continue
            nodes[POSITIONAL_PARAMETERS[index]] = arg
        for keyword in call.keywords:
            if keyword.arg is None:
                self.fail(keyword.value, f"{marker.name}: **kwargs is not allowed; pass literals by keyword")
            elif keyword.arg in nodes:
                self.fail(keyword.value, f"{marker.name}: {keyword.arg} is given twice")
            elif keyword.arg not in marker.parameters:
                self.fail(
                    keyword.value,
                    f"{marker.name} has no parameter {keyword.arg!r}"
                    + closest(keyword.arg, marker.parameters),
                )
            else:
                nodes[keyword.arg] = keyword.value
        for name, node in nodes.items():
            try:
                values[name] = ast.literal_eval(node)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                self.fail(
                    node,
                    f"{marker.name}: {name} must be a literal (test files are never imported), got {ast.unparse(node)}",
                )
        for required in POSITIONAL_PARAMETERS:
            if required not in nodes:
                self.fail(call, f"{marker.name}: missing required argument {required!r}")
        for name, value in values.items():
            message = _check_value(name, value)
            if message:
                self.fail(nodes[name], f"{marker.name}: {message}")
        if values.get("issue") is not None and values.get("disabled") is None:
            self.fail(
                nodes["issue"],
                f'{marker.name}: issue= tracks why an entry is disabled; it needs disabled="reason"',
            )
        if len(self.problems) > before:
            return
        est = nodes["est_time"]
        self.registrations.append(
            Registration(
                path=self.path,
                line=call.lineno,
                hardware=marker.hardware,
                marker=marker.name,
                est_time=float(values["est_time"]),
                suite=values["suite"],
                labels=tuple(values.get("labels") or ()),
                nightly=values.get("nightly", False),
                disabled=values.get("disabled"),
                issue=values.get("issue"),
                num_gpus=values.get("num_gpus"),
                layout=values.get("layout"),
                declared_gpus=self.declared_gpus,
                est_span=(est.lineno, est.col_offset, est.end_lineno or est.lineno, est.end_col_offset or 0),
            )
        )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


#: parameter -> (accepts the literal value, the rule in words)
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "est_time": (
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
        "a positive number of seconds",
    ),
    "suite": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "labels": (
        lambda v: (
            v is None
            or (
                isinstance(v, list | tuple)
                and all(isinstance(x, str) and x for x in v)
                and len(set(v)) == len(v)
            )
        ),
        "a list of distinct label names",
    ),
    "nightly": (lambda v: isinstance(v, bool), "True or False"),
    "disabled": (
        lambda v: v is None or (isinstance(v, str) and bool(v.strip())),
        "a non-empty reason string",
    ),
    "issue": (
        lambda v: v is None or (isinstance(v, str) and bool(ISSUE_RE.match(v))),
        "a URL or an issue reference like owner/repo#12",
    ),
    "num_gpus": (lambda v: v is None or (_is_int(v) and v >= 1), "a positive integer"),
    "layout": (
        lambda v: (
            v is None
            or (isinstance(v, dict) and all(isinstance(k, str) and _is_int(x) for k, x in v.items()))
        ),
        "a dict of axis name to integer, like {'tp': 2, 'pp': 2}",
    ),
}


def _check_value(name: str, value: Any) -> str | None:
    """Why ``value`` is not acceptable for marker parameter ``name`` (None when it is)."""
    accepts, rule = _RULES[name]
    return None if accepts(value) else f"{name} must be {rule}, got {value!r}"
