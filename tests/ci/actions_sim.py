"""A small model of GitHub Actions for testing generated workflows as behaviour, not text.

* :func:`evaluate` -- the expression language (``${{ ... }}``): literals, contexts, property and
  index access, the ``.*`` object filter, ``! == != < <= > >= && ||`` with GitHub's loose
  equality (strings case-insensitive, other types coerced to numbers) and value-returning
  ``&&``/``||``, and the functions contains, startsWith, endsWith, format, join, toJSON,
  fromJSON and the status functions.
* :func:`simulate` -- what one event starts: which workflow files it triggers (``on`` with
  ``types`` and ``branches``), from which commit GitHub reads them (the pull request's merge
  commit for ``pull_request``, the default branch for ``pull_request_target``, ``push`` and
  ``schedule``), each job's ``if`` in ``needs`` order, reusable-workflow calls (local and
  ``owner/repo/...@ref``) with the caller's ``github`` context, the runner labels, the secrets
  each job receives, the commit it checks out, and the runner-group rule that only jobs defined
  in a selected workflow file at a selected ref reach self-hosted runners.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from graphlib import TopologicalSorter
from typing import Any

import yaml

# -- expressions ----------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"\s*(?:(?P<num>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|0x[0-9a-fA-F]+)|(?P<str>'(?:[^']|'')*')"
    r"|(?P<op>==|!=|<=|>=|&&|\|\||[()\[\],.!<>*])|(?P<name>[A-Za-z_][A-Za-z0-9_-]*))"
)


class Filtered(list):
    """The result of ``.*``: a following ``.name`` maps over the elements."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise SyntaxError(f"cannot tokenize {text[pos:]!r}")
        kind = match.lastgroup
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


def truthy(value: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return not (value == 0 or math.isnan(value))
    if isinstance(value, str):
        return value != ""
    return True


def _number(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if text == "":
            return 0.0
        try:
            return float(int(text, 16)) if text.lower().startswith("0x") else float(text)
        except ValueError:
            return math.nan
    return math.nan


def loose_equal(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    if isinstance(a, (list, dict)) or isinstance(b, (list, dict)):
        return a is b
    if type(a) is type(b) and a is None:
        return True
    return _number(a) == _number(b)


def to_string(value: Any) -> str:
    if value is None:
        return ""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _format(pattern: str, *args: Any) -> str:
    def field(match: re.Match[str]) -> str:
        if match.group(0) == "{{":
            return "{"
        if match.group(0) == "}}":
            return "}"
        return to_string(args[int(match.group(1))])

    return re.sub(r"\{\{|\}\}|\{(\d+)\}", field, pattern)


def _contains(search: Any, item: Any) -> bool:
    if isinstance(search, list):
        return any(loose_equal(element, item) for element in search)
    return to_string(item).lower() in to_string(search).lower()


FUNCTIONS = {
    "contains": _contains,
    "startswith": lambda a, b: to_string(a).lower().startswith(to_string(b).lower()),
    "endswith": lambda a, b: to_string(a).lower().endswith(to_string(b).lower()),
    "format": _format,
    "join": lambda items, sep=",": (
        to_string(sep).join(to_string(i) for i in items) if isinstance(items, list) else to_string(items)
    ),
    "tojson": lambda value: json.dumps(value, indent=2),
    "fromjson": lambda text: json.loads(text),
}
STATUS_FUNCTIONS = ("success", "failure", "cancelled", "always")


class _Parser:
    def __init__(self, text: str, contexts: dict[str, Any], status: dict[str, bool]) -> None:
        self.tokens = _tokens(text)
        self.pos = 0
        self.contexts = contexts
        self.status = status

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None or (value is not None and token[1] != value):
            raise SyntaxError(f"expected {value!r}, got {token!r}")
        self.pos += 1
        return token

    def parse(self) -> Any:
        value = self.or_()
        if self.peek() is not None:
            raise SyntaxError(f"unexpected {self.peek()!r}")
        return value

    def or_(self) -> Any:
        value = self.and_()
        while self.peek() == ("op", "||"):
            self.take()
            right = self.and_()
            value = value if truthy(value) else right
        return value

    def and_(self) -> Any:
        value = self.equality()
        while self.peek() == ("op", "&&"):
            self.take()
            right = self.equality()
            value = right if truthy(value) else value
        return value

    def equality(self) -> Any:
        value = self.comparison()
        while self.peek() in (("op", "=="), ("op", "!=")):
            op = self.take()[1]
            right = self.comparison()
            value = loose_equal(value, right) if op == "==" else not loose_equal(value, right)
        return value

    def comparison(self) -> Any:
        value = self.unary()
        while self.peek() in (("op", "<"), ("op", "<="), ("op", ">"), ("op", ">=")):
            op = self.take()[1]
            a, b = value, self.unary()
            if isinstance(a, str) and isinstance(b, str):
                a, b = a.lower(), b.lower()
            else:
                a, b = _number(a), _number(b)
            value = {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]
        return value

    def unary(self) -> Any:
        if self.peek() == ("op", "!"):
            self.take()
            return not truthy(self.unary())
        return self.postfix(self.primary())

    def primary(self) -> Any:
        kind, text = self.take()
        if kind == "num":
            return float(int(text, 16)) if text.lower().startswith("0x") else float(text)
        if kind == "str":
            return text[1:-1].replace("''", "'")
        if (kind, text) == ("op", "("):
            value = self.or_()
            self.take(")")
            return value
        if kind == "name":
            lowered = text.lower()
            if lowered in ("true", "false"):
                return lowered == "true"
            if lowered == "null":
                return None
            if self.peek() == ("op", "("):
                self.take("(")
                args = []
                while self.peek() != ("op", ")"):
                    args.append(self.or_())
                    if self.peek() == ("op", ","):
                        self.take()
                self.take(")")
                if lowered in STATUS_FUNCTIONS:
                    return self.status[lowered]
                if lowered not in FUNCTIONS:
                    raise SyntaxError(f"unknown function {text}")
                return FUNCTIONS[lowered](*args)
            if text not in self.contexts:
                raise SyntaxError(f"unknown context {text}")
            return self.contexts[text]
        raise SyntaxError(f"unexpected {text!r}")

    def postfix(self, value: Any) -> Any:
        while self.peek() in (("op", "."), ("op", "[")):
            if self.take()[1] == ".":
                _, name = self.take()
                if name == "*":
                    value = Filtered(value.values() if isinstance(value, dict) else value or [])
                elif isinstance(value, Filtered):
                    value = Filtered(_prop(v, name) for v in value if isinstance(v, dict))
                else:
                    value = _prop(value, name)
            else:
                if self.peek() == ("op", "*"):
                    self.take()
                    self.take("]")
                    value = Filtered(value.values() if isinstance(value, dict) else value or [])
                    continue
                index = self.or_()
                self.take("]")
                if isinstance(value, list) and not isinstance(index, str):
                    i = int(_number(index))
                    value = value[i] if 0 <= i < len(value) else None
                else:
                    value = _prop(value, to_string(index))
        return value


def _prop(value: Any, name: str) -> Any:
    if not isinstance(value, dict):
        return None
    for key, item in value.items():
        if key.lower() == name.lower():
            return item
    return None


DEFAULT_STATUS = {"success": True, "failure": False, "cancelled": False, "always": True}


def evaluate(expression: Any, contexts: dict[str, Any], status: dict[str, bool] | None = None) -> Any:
    """The value of a workflow field: a bare expression, ``${{ expr }}``, or a string with
    ``${{ }}`` parts (interpolated as text)."""
    if not isinstance(expression, str):
        return expression
    status = status or DEFAULT_STATUS
    whole = re.fullmatch(r"\s*\$\{\{(.*)\}\}\s*", expression, re.S)
    if whole and "${{" not in whole.group(1):
        return _Parser(whole.group(1), contexts, status).parse()
    if "${{" not in expression:
        return expression
    return re.sub(
        r"\$\{\{(.*?)\}\}", lambda m: to_string(_Parser(m.group(1), contexts, status).parse()), expression
    )


def condition(expression: Any, contexts: dict[str, Any], status: dict[str, bool]) -> bool:
    """A job's ``if``: a bare expression; ``success() &&`` is implied without a status function."""
    if expression is None:
        return status["success"]
    text = expression if isinstance(expression, str) else json.dumps(expression)
    whole = re.fullmatch(r"\s*\$\{\{(.*)\}\}\s*", text, re.S)
    text = whole.group(1) if whole else text
    value = truthy(_Parser(text, contexts, status).parse())
    if not re.search(r"\b(success|failure|cancelled|always)\s*\(", text):
        value = value and status["success"]
    return value


# -- events and runs -----------------------------------------------------------------------------

REPO = "org/repo"
BASE_SHA = "b" * 40
HEAD_SHA = "c" * 40
MERGE_SHA = "d" * 40
SECRET = "<secret {}>"


@dataclass
class Event:
    """What happened: the GitHub event name(s) it is delivered as and its payload."""

    deliveries: list[tuple[str, str, str]]  # (event name, ref, sha)
    payload: dict[str, Any]
    inputs: dict[str, Any] = field(default_factory=dict)


def pr_event(
    action: str, labels: list[str], *, fork: bool, label: str | None = None, number: int = 5
) -> Event:
    payload: dict[str, Any] = {
        "action": action,
        "number": number,
        "pull_request": {
            "number": number,
            "labels": [{"name": n} for n in labels],
            "head": {"sha": HEAD_SHA, "repo": {"full_name": "someone/fork" if fork else REPO}},
            "base": {"ref": "main", "repo": {"full_name": REPO}},
        },
    }
    if label is not None:
        payload["label"] = {"name": label}
    return Event(
        [
            ("pull_request", f"refs/pull/{number}/merge", MERGE_SHA),
            ("pull_request_target", "refs/heads/main", BASE_SHA),
        ],
        payload,
    )


def push_event(branch: str = "main") -> Event:
    return Event([("push", f"refs/heads/{branch}", HEAD_SHA)], {"ref": f"refs/heads/{branch}"})


def schedule_event() -> Event:
    return Event([("schedule", "refs/heads/main", BASE_SHA)], {"schedule": "0 15 * * *"})


def dispatch_event(branch: str = "main", **inputs: Any) -> Event:
    return Event([("workflow_dispatch", f"refs/heads/{branch}", HEAD_SHA)], {"inputs": inputs}, inputs)


@dataclass
class JobRun:
    workflow: str
    job: str  # caller job id, or "caller/called" for a reusable workflow's job
    ran: bool
    runs_on: list[str] = field(default_factory=list)
    refused: bool = False  # a self-hosted job the runner group does not admit
    secrets: dict[str, Any] = field(default_factory=dict)
    checkout: Any = None
    inputs: dict[str, Any] = field(default_factory=dict)
    matrix: int = 1

    @property
    def self_hosted(self) -> bool:
        return "self-hosted" in self.runs_on

    @property
    def on_runner(self) -> bool:
        """It got a runner (ran, and was admitted if self-hosted)."""
        return self.ran and not self.refused


@dataclass
class WorkflowRun:
    workflow: str
    event_name: str
    concurrency: tuple[str, bool] | None
    jobs: list[JobRun]


def _triggered(doc: dict[str, Any], event_name: str, payload: dict[str, Any], ref: str) -> bool:
    on = doc.get("on", doc.get(True))
    if isinstance(on, str):
        on = {on: None}
    elif isinstance(on, list):
        on = {name: None for name in on}
    if event_name not in on:
        return False
    spec = on[event_name] or {}
    if event_name in ("pull_request", "pull_request_target"):
        types = spec.get("types", ["opened", "synchronize", "reopened"]) if isinstance(spec, dict) else None
        return payload["action"] in types
    if event_name == "push" and isinstance(spec, dict) and "branches" in spec:
        return ref.removeprefix("refs/heads/") in spec["branches"]
    return True


def _matrix_cells(job: dict[str, Any]) -> list[dict[str, Any]]:
    matrix = (job.get("strategy") or {}).get("matrix") or {}
    cells: list[dict[str, Any]] = [{}]
    for key, values in matrix.items():
        cells = [cell | {key: v} for cell in cells for v in values]
    return cells


def simulate(
    event: Event,
    base: dict[str, str],
    head: dict[str, str] | None = None,
    *,
    allowed: list[str] | None = None,
    secrets: list[str] = (),
) -> list[WorkflowRun]:
    """Every workflow run ``event`` starts. ``base``: file name -> text on the default branch;
    ``head``: the pull request's merge commit (default: the same files); ``allowed``: the runner
    group's selected workflows as ``file@ref`` (None: every workflow reaches every runner)."""
    docs = {"base": {n: yaml.safe_load(t) for n, t in base.items()}}
    docs["head"] = {n: yaml.safe_load(t) for n, t in (head if head is not None else base).items()}
    runs = []
    for event_name, ref, sha in event.deliveries:
        source = "head" if event_name == "pull_request" else "base"
        for name, doc in docs[source].items():
            if (
                "workflow_call" in (doc.get("on", doc.get(True)) or {})
                and len(doc.get("on", doc.get(True))) == 1
            ):
                continue  # reusable only
            if not _triggered(doc, event_name, event.payload, ref):
                continue
            github = {
                "event_name": event_name,
                "event": event.payload,
                "repository": REPO,
                "ref": ref,
                "sha": sha,
                "workflow": doc.get("name", name),
                "workflow_ref": f"{REPO}/.github/workflows/{name}@{ref}",
                "run_id": "1234",
            }
            contexts = {"github": github, "inputs": event.inputs, "vars": {}, "env": {}}
            concurrency = None
            if doc.get("concurrency"):
                c = doc["concurrency"]
                group = evaluate(c["group"] if isinstance(c, dict) else c, contexts)
                cancel = (
                    truthy(evaluate(c.get("cancel-in-progress", False), contexts))
                    if isinstance(c, dict)
                    else False
                )
                concurrency = (group, cancel)
            jobs = _run_jobs(doc, name, docs, source, ref, contexts, allowed, secrets)
            runs.append(WorkflowRun(name, event_name, concurrency, jobs))
    return runs


def _run_jobs(
    doc: dict[str, Any],
    name: str,
    docs: dict[str, dict[str, Any]],
    source: str,
    ref: str,
    contexts: dict[str, Any],
    allowed: list[str] | None,
    secrets: list[str],
) -> list[JobRun]:
    jobs = doc.get("jobs", {})
    needs = {
        j: ([spec["needs"]] if isinstance(spec.get("needs"), str) else spec.get("needs", []))
        for j, spec in jobs.items()
    }
    results: dict[str, str] = {}
    out: list[JobRun] = []
    secret_values = {s: SECRET.format(s) for s in secrets}
    for job_id in TopologicalSorter(needs).static_order():
        spec = jobs[job_id]
        states = [results[n] for n in needs[job_id]]
        status = {
            "success": all(s == "success" for s in states),
            "failure": any(s == "failure" for s in states),
            "cancelled": False,
            "always": True,
        }
        if not condition(spec.get("if"), contexts, status):
            results[job_id] = "skipped"
            out.append(JobRun(name, job_id, False))
            continue
        cells = _matrix_cells(spec)
        scope = contexts | {"matrix": cells[0], "secrets": secret_values, "needs": {}}
        if "uses" in spec:
            uses = spec["uses"]
            if uses.startswith("./.github/workflows/"):
                called_name, called_ref, called_source = uses.rsplit("/", 1)[1], ref, source
            else:  # owner/repo/.github/workflows/file.yml@ref
                path, _, at = uses.partition("@")
                called_name, called_ref, called_source = path.rsplit("/", 1)[1], f"refs/heads/{at}", "base"
            called = docs[called_source][called_name]
            inputs = {k: evaluate(v, scope) for k, v in (spec.get("with") or {}).items()}
            passed = spec.get("secrets") or {}
            received = (
                dict(secret_values)
                if passed == "inherit"
                else {k: evaluate(v, scope) for k, v in passed.items()}
            )
            inner_scope = contexts | {"inputs": inputs, "secrets": received, "matrix": cells[0], "needs": {}}
            for inner_id, inner in called["jobs"].items():
                run = _job_run(
                    inner,
                    f"{job_id}/{inner_id}",
                    name,
                    called_name,
                    called_ref,
                    inner_scope,
                    allowed,
                    len(cells),
                )
                run.secrets = received
                out.append(run)
            results[job_id] = "success"
        else:
            out.append(_job_run(spec, job_id, name, name, ref, scope, allowed, len(cells)))
            results[job_id] = "success"
    return out


def _job_run(
    spec: dict[str, Any],
    job: str,
    workflow: str,
    defined_in: str,
    ref: str,
    scope: dict[str, Any],
    allowed: list[str] | None,
    cells: int,
) -> JobRun:
    if not condition(spec.get("if"), scope, DEFAULT_STATUS):
        return JobRun(workflow, job, False)
    runs_on = evaluate(spec.get("runs-on"), scope)
    runs_on = [runs_on] if isinstance(runs_on, str) else list(runs_on or [])
    checkout = None
    for step in spec.get("steps", []):
        if str(step.get("uses", "")).startswith("actions/checkout@"):
            checkout = evaluate((step.get("with") or {}).get("ref"), scope)
    refused = "self-hosted" in runs_on and allowed is not None and f"{defined_in}@{ref}" not in allowed
    return JobRun(
        workflow,
        job,
        True,
        runs_on=runs_on,
        refused=refused,
        checkout=checkout,
        inputs=dict(scope.get("inputs") or {}),
        matrix=cells,
    )
