"""Plugin discovery, filtering, error policy, per-concern contributions and the fingerprint.

Plugins are modules named by entry points in the group ``miles.plugins`` (built-ins included).
Environment:

* ``MILES_PLUGINS=a,b`` -- allow list. Only these third-party plugins are loaded; the core's own
  built-ins (distribution ``miles``) are always allowed. Names are plugin (entry-point) names or
  distribution names.
* ``MILES_DISABLE_PLUGINS=a,b`` -- deny list; applies to every plugin, built-ins included, and
  wins over the allow list. A denied plugin is never imported.
* ``MILES_PLUGIN_ERRORS=raise`` -- strict: the first import, hook or verification error raises
  instead of being recorded (default ``record``).

A plugin's status is ``ok``, ``blocked`` (filtered by the lists above; the reason names the
variable) or ``broken`` (import, registration, hook or verification error; the reason carries the
error text). Broken plugins never crash commands that do not need them: listing always works.
Activating a concern (:meth:`MilesPluginManager.active_contributions`) fails closed when a plugin
that is -- or may be -- contributing to it is broken.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import pluggy

from miles_core import hookspecs
from miles_core.entry_points import entry_points
from miles_core.errors import ActivationError, ConfigError, PluginLoadError

if TYPE_CHECKING:
    import click

ENV_ALLOW = "MILES_PLUGINS"
ENV_DENY = "MILES_DISABLE_PLUGINS"
ENV_ERRORS = "MILES_PLUGIN_ERRORS"
CORE_DISTRIBUTION = "miles"

#: concern name -> the hook that contributes objects to it
CONCERN_HOOKS: dict[str, str] = {
    "hardware": "miles_hardware_backends",
    "patches": "miles_model_patches",
    "session": "miles_session_versions",
    "sandbox": "miles_sandbox_providers",
    "ci": "miles_ci_hardware",
    "tasks": "miles_tasks",
    "engine": "miles_inference_engines",
}

Stage = Literal["import", "register", "hook", "verify", "conflict"]
T = TypeVar("T")


@dataclass(frozen=True)
class Problem:
    """One thing that went wrong with a plugin."""

    stage: Stage
    message: str
    concern: str | None = None
    detail: str | None = None  # traceback text, for `miles plugins show`

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "concern": self.concern, "message": self.message}


@dataclass
class PluginRecord:
    """What the core knows about one discovered or registered plugin."""

    name: str
    module_path: str
    distribution: str | None
    version: str | None
    builtin: bool
    module: ModuleType | object | None = field(default=None, repr=False)
    blocked_reason: str | None = None
    problems: list[Problem] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    contributes: dict[str, list[str]] = field(default_factory=dict)
    import_ms: float | None = None

    @property
    def status(self) -> Literal["ok", "broken", "blocked"]:
        if self.blocked_reason is not None:
            return "blocked"
        return "broken" if self.problems else "ok"

    @property
    def reason(self) -> str | None:
        if self.blocked_reason is not None:
            return self.blocked_reason
        if self.problems:
            return "; ".join(f"{p.stage}: {p.message}" for p in self.problems)
        return None

    @property
    def label(self) -> str:
        """``name (distribution version)``, used in every error message."""
        return f"{self.name!r} ({self.distribution or 'unknown distribution'} {self.version or '?'})"

    def broken_for(self, concern: str) -> list[Problem]:
        """Problems that make this plugin unusable for ``concern``.

        Import and registration failures count for every concern: what the plugin would have
        contributed is unknown, so activation fails closed.
        """
        return [p for p in self.problems if p.stage in ("import", "register") or p.concern in (concern, None)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module_path,
            "builtin": self.builtin,
            "status": self.status,
            "reason": self.reason,
            "hooks": sorted(self.hooks),
            "contributes": {k: v for k, v in sorted(self.contributes.items()) if v},
            "problems": [p.to_dict() for p in self.problems],
        }


@dataclass(frozen=True)
class Contribution:
    """An object a plugin contributed to a concern, with its provenance."""

    concern: str
    name: str
    obj: Any
    plugin: PluginRecord

    def error(self, cause: str) -> ActivationError:
        """An ActivationError naming this contribution's plugin, distribution, version and object."""
        return ActivationError(
            plugin=self.plugin.name,
            distribution=self.plugin.distribution,
            version=self.plugin.version,
            obj=self.name,
            cause=cause,
            concern=self.concern,
        )


def _parse_list(value: str | None) -> frozenset[str] | None:
    if value is None or not value.strip():
        return None
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def _hook_names() -> frozenset[str]:
    return frozenset(n for n in dir(hookspecs) if n.startswith("miles_"))


class MilesPluginManager:
    """Loads plugins and hands out their contributions, attributed and error-isolated."""

    def __init__(
        self,
        *,
        allow: Iterable[str] | None = None,
        deny: Iterable[str] | None = None,
        errors: Literal["record", "raise"] = "record",
    ) -> None:
        if errors not in ("record", "raise"):
            raise ConfigError(f"{ENV_ERRORS} must be 'record' or 'raise', got {errors!r}")
        self.allow = frozenset(allow) if allow is not None else None
        self.deny = frozenset(deny or ())
        self.errors = errors
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._records: dict[str, PluginRecord] = {}
        self._contributions: dict[str, list[Contribution]] = {}
        self._applied_patches: dict[str, list[str]] = {}
        self._commands_added = False
        self._lock = threading.RLock()
        self.warnings: list[str] = []

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> MilesPluginManager:
        env = os.environ if environ is None else environ
        errors = env.get(ENV_ERRORS, "record").strip().lower() or "record"
        if errors not in ("record", "raise"):
            raise ConfigError(f"{ENV_ERRORS} must be 'record' or 'raise', got {errors!r}")
        return cls(
            allow=_parse_list(env.get(ENV_ALLOW)),
            deny=_parse_list(env.get(ENV_DENY)),
            errors=errors,  # type: ignore[arg-type]
        )

    # -- discovery and registration ---------------------------------------------------------

    def _blocked_reason(self, name: str, distribution: str | None, builtin: bool) -> str | None:
        names = {name} | ({distribution} if distribution else set())
        if names & self.deny:
            return f"disabled by {ENV_DENY}"
        if self.allow is not None and not builtin and not names & self.allow:
            return f"not in {ENV_ALLOW}"
        return None

    def discover(self, group: str = hookspecs.ENTRY_POINT_GROUP) -> None:
        """Find, filter, import and register every entry-point plugin of ``group``."""
        eps = sorted(
            entry_points(group),
            key=lambda ep: (ep.distribution != CORE_DISTRIBUTION, ep.name),
        )
        for ep in eps:
            dist_name = ep.distribution
            record = PluginRecord(
                name=ep.name,
                module_path=ep.value,
                distribution=dist_name,
                version=ep.version,
                builtin=dist_name == CORE_DISTRIBUTION,
            )
            if ep.name in self._records:
                other = self._records[ep.name]
                record.problems.append(
                    Problem("conflict", f"plugin name {ep.name!r} is also used by {other.label}")
                )
                self._records[f"{ep.name}@{dist_name}"] = record
                self._fail(record)
                continue
            self._records[ep.name] = record
            record.blocked_reason = self._blocked_reason(ep.name, dist_name, record.builtin)
            if record.blocked_reason is not None:
                continue
            started = time.perf_counter()
            try:
                module = import_object(ep.value)
            except Exception as exc:  # a broken plugin must not take the CLI down
                record.problems.append(Problem("import", _describe(exc), detail=_traceback()))
                self._fail(record)
                continue
            finally:
                record.import_ms = (time.perf_counter() - started) * 1000
            self._register_module(record, module)
        self._warn_unknown_filters()

    def register(
        self,
        plugin: ModuleType | object,
        *,
        name: str,
        distribution: str | None = None,
        version: str | None = None,
        builtin: bool = False,
    ) -> PluginRecord:
        """Register an already-imported plugin object (used by tests and embedding code)."""
        with self._lock:
            if name in self._records:
                raise ValueError(f"a plugin named {name!r} is already registered")
            record = PluginRecord(
                name=name,
                module_path=getattr(plugin, "__name__", type(plugin).__name__),
                distribution=distribution,
                version=version,
                builtin=builtin,
            )
            self._records[name] = record
            record.blocked_reason = self._blocked_reason(name, distribution, builtin)
            if record.blocked_reason is None:
                self._register_module(record, plugin)
            self._contributions.clear()
            return record

    def _register_module(self, record: PluginRecord, module: ModuleType | object) -> None:
        record.module = module
        try:
            self._pm.register(module, name=record.name)
        except Exception as exc:
            record.problems.append(Problem("register", _describe(exc), detail=_traceback()))
            self._fail(record)
            return
        known = _hook_names()
        callers = self._pm.get_hookcallers(module) or []
        record.hooks = sorted(hc.name for hc in callers)
        unknown = [h for h in record.hooks if h not in known]
        if unknown:
            self._pm.unregister(module)
            record.hooks = []
            record.problems.append(Problem("register", f"implements unknown hook(s) {', '.join(unknown)}"))
            self._fail(record)

    def _warn_unknown_filters(self) -> None:
        known = {r.name for r in self._records.values()} | {
            r.distribution for r in self._records.values() if r.distribution
        }
        for var, names in ((ENV_ALLOW, self.allow or frozenset()), (ENV_DENY, self.deny)):
            for unknown in sorted(names - known):
                self.warnings.append(f"{var} names {unknown!r}, which is not an installed plugin")

    def _fail(self, record: PluginRecord) -> None:
        if self.errors == "raise":
            raise PluginLoadError(f"plugin {record.label} is broken: {record.reason}")

    # -- queries ----------------------------------------------------------------------------

    def plugins(self) -> list[PluginRecord]:
        return list(self._records.values())

    def get(self, name: str) -> PluginRecord:
        try:
            return self._records[name]
        except KeyError:
            for record in self._records.values():
                if record.distribution == name:
                    return record
            raise KeyError(name) from None

    def contributions(self, concern: str) -> list[Contribution]:
        """Every object contributed to ``concern`` by plugins that are not blocked.

        Each plugin's hook implementation is called separately; one that raises or returns
        something malformed marks that plugin broken for the concern and contributes nothing.
        """
        if concern not in CONCERN_HOOKS:
            raise ValueError(f"unknown concern {concern!r}; known: {', '.join(CONCERN_HOOKS)}")
        with self._lock:
            if concern in self._contributions:
                return list(self._contributions[concern])
            hook_name = CONCERN_HOOKS[concern]
            impls = {impl.plugin_name: impl for impl in getattr(self._pm.hook, hook_name).get_hookimpls()}
            seen: dict[str, Contribution] = {}
            out: list[Contribution] = []
            for record in self._records.values():
                impl = impls.get(record.name)
                if impl is None or record.status == "blocked":
                    continue
                try:
                    result = impl.function()
                    objects = _validate_contributions(result, hook_name)
                except Exception as exc:
                    record.problems.append(
                        Problem("hook", f"{hook_name} raised {_describe(exc)}", concern, _traceback())
                    )
                    self._fail(record)
                    continue
                names: list[str] = []
                for obj in objects:
                    if obj.name in seen:
                        other = seen[obj.name].plugin
                        record.problems.append(
                            Problem(
                                "conflict",
                                f"{concern} {obj.name!r} is already provided by plugin {other.label}",
                                concern,
                            )
                        )
                        self._fail(record)
                        continue
                    contribution = Contribution(concern, obj.name, obj, record)
                    seen[obj.name] = contribution
                    out.append(contribution)
                    names.append(obj.name)
                record.contributes[concern] = names
            self._contributions[concern] = out
            return list(out)

    def collect_all(self) -> None:
        """Call every contribution hook once (what ``miles plugins list`` shows)."""
        for concern in CONCERN_HOOKS:
            self.contributions(concern)

    def broken_for(self, concern: str) -> list[tuple[PluginRecord, list[Problem]]]:
        self.contributions(concern)
        out = []
        for record in self._records.values():
            if record.status == "blocked":
                continue
            problems = record.broken_for(concern)
            if problems:
                out.append((record, problems))
        return out

    def active_contributions(self, concern: str) -> list[Contribution]:
        """Contributions for activating ``concern``; fails closed if a relevant plugin is broken."""
        contributions = self.contributions(concern)
        broken = self.broken_for(concern)
        if broken:
            lines = [
                f"plugin {record.label} is broken ({'; '.join(p.stage + ': ' + p.message for p in problems)})"
                for record, problems in broken
            ]
            names = ",".join(record.name for record, _ in broken)
            raise PluginLoadError(
                f"cannot activate {concern}: "
                + "; ".join(lines)
                + f". Fix the plugin, or exclude it with {ENV_DENY}={names}"
            )
        return contributions

    def contribution(self, concern: str, name: str) -> Contribution:
        for c in self.active_contributions(concern):
            if c.name == name:
                return c
        known = ", ".join(sorted(c.name for c in self.contributions(concern))) or "none"
        raise ConfigError(f"no {concern} named {name!r} is registered (known: {known})")

    # -- activation -------------------------------------------------------------------------

    def verify(self, contribution: Contribution, check: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``check`` (a verify method) for ``contribution``; fail closed with provenance."""
        try:
            return check(*args, **kwargs)
        except Exception as exc:
            record = contribution.plugin
            cause = _describe(exc)
            record.problems.append(
                Problem(
                    "verify",
                    f"{contribution.concern} {contribution.name!r}: {cause}",
                    contribution.concern,
                    _traceback(),
                )
            )
            raise contribution.error(cause) from exc

    def record_applied_patch(self, patch: str, classes: Iterable[str]) -> None:
        """Record that ``patch`` was applied and verified on ``classes`` (enters the fingerprint)."""
        with self._lock:
            merged = set(self._applied_patches.get(patch, ())) | set(classes)
            self._applied_patches[patch] = sorted(merged)

    @property
    def applied_patches(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in sorted(self._applied_patches.items())}

    def fingerprint(self) -> dict[str, Any]:
        """What other processes compare to prove they loaded the same plugins and patches."""
        body = {
            "plugins": sorted([r.name, r.distribution, r.version, r.status] for r in self._records.values()),
            "applied_patches": self.applied_patches,
        }
        import hashlib
        import json

        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return {**body, "digest": hashlib.sha256(canonical.encode()).hexdigest()}

    # -- CLI --------------------------------------------------------------------------------

    def add_commands(self, cli: click.Group) -> None:
        """Let plugins add subcommands; a plugin that replaces an existing command is broken."""
        with self._lock:
            if self._commands_added:
                return
            self._commands_added = True
            for impl in self._pm.hook.miles_commands.get_hookimpls():
                record = self._records[impl.plugin_name]
                before = dict(cli.commands)
                try:
                    impl.function(cli=cli)
                except Exception as exc:
                    cli.commands.clear()
                    cli.commands.update(before)
                    record.problems.append(
                        Problem(
                            "hook",
                            f"miles_commands raised {_describe(exc)}",
                            "commands",
                            _traceback(),
                        )
                    )
                    self._fail(record)
                    continue
                clobbered = [n for n, cmd in before.items() if cli.commands.get(n) is not cmd]
                if clobbered:
                    cli.commands.clear()
                    cli.commands.update(before)
                    record.problems.append(
                        Problem(
                            "conflict",
                            f"miles_commands tried to replace command(s) {', '.join(clobbered)}",
                            "commands",
                        )
                    )
                    self._fail(record)
                    continue
                record.contributes["commands"] = sorted(set(cli.commands) - set(before))


def fingerprint_mismatch(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they match)."""
    if expected.get("digest") == actual.get("digest"):
        return []
    diffs: list[str] = []
    exp_plugins = {p[0]: p for p in expected.get("plugins", [])}
    act_plugins = {p[0]: p for p in actual.get("plugins", [])}
    for name in sorted(exp_plugins.keys() | act_plugins.keys()):
        if exp_plugins.get(name) != act_plugins.get(name):
            diffs.append(f"plugin {name}: expected {exp_plugins.get(name)}, found {act_plugins.get(name)}")
    exp_patches = expected.get("applied_patches", {})
    act_patches = actual.get("applied_patches", {})
    for name in sorted(exp_patches.keys() | act_patches.keys()):
        if exp_patches.get(name) != act_patches.get(name):
            diffs.append(f"patch {name}: expected {exp_patches.get(name)}, found {act_patches.get(name)}")
    return diffs or ["fingerprint digests differ"]


def _validate_contributions(result: Any, hook_name: str) -> list[Any]:
    if result is None:
        raise TypeError(f"{hook_name} returned None; return a list (possibly empty)")
    if isinstance(result, (str, bytes)) or not isinstance(result, (list, tuple)):
        raise TypeError(f"{hook_name} must return a list, got {type(result).__name__}")
    for obj in result:
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{hook_name} returned {obj!r} without a non-empty str 'name'")
        if not callable(getattr(obj, "verify", None)):
            raise TypeError(f"{hook_name} returned {name!r} without a callable verify()")
    return list(result)


def _traceback() -> str:
    import traceback  # only on the error path: it pulls in linecache and tokenize

    return traceback.format_exc()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_manager: MilesPluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> MilesPluginManager:
    """The process-wide plugin manager, discovered from entry points on first use."""
    global _manager
    with _manager_lock:
        if _manager is None:
            manager = MilesPluginManager.from_environment()
            manager.discover()
            _manager = manager
        return _manager


def set_plugin_manager(manager: MilesPluginManager | None) -> MilesPluginManager | None:
    """Install ``manager`` as the process-wide one (``None`` re-discovers on next use).

    Returns the previous manager so callers (the pytest fixture) can restore it.
    """
    global _manager
    with _manager_lock:
        previous, _manager = _manager, manager
        return previous


def import_object(path: str) -> Any:
    """Import ``package.module:attr`` (or a module path)."""
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module
