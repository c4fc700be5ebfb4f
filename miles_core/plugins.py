"""Plugin discovery, filtering, error policy, per-concern contributions and the fingerprint.

Plugins are modules named by entry points in the group ``miles.plugins`` (built-ins included). A
plugin's identity is its (distribution, entry-point name) pair, written ``DIST:NAME``
(:attr:`PluginRecord.key`): two distributions may not share an entry-point name, and neither of
two that do is loaded (see :meth:`MilesPluginManager.discover`). Environment:

* ``MILES_PLUGINS=a,b`` -- allow list. Only these third-party plugins are loaded; the core's own
  built-ins (distribution ``miles``) are always allowed.
* ``MILES_DISABLE_PLUGINS=a,b`` -- deny list; applies to every plugin, built-ins included, and
  wins over the allow list. A denied plugin is never imported.
* In both lists an item is an entry-point name (every plugin of that name), a distribution name
  (every plugin of that distribution; ``-``, ``_`` and ``.`` are alike, case is ignored) or
  ``DIST:NAME`` (exactly one plugin). Both lists apply before name conflicts are judged.
* ``MILES_PLUGIN_ERRORS=raise`` -- strict: the first import, hook or verification error raises
  instead of being recorded (default ``record``). Listing (:func:`listing_plugin_manager`)
  records anyway and reports what strict mode would have decided.

A plugin's status is ``ok``, ``blocked`` (filtered by the lists above; the reason names the
variable) or ``broken`` (import, registration, hook, verification error or a name conflict; the
reason carries the error text). Broken plugins never crash commands that do not need them:
listing always works. Activating a concern (:meth:`MilesPluginManager.active_contributions`)
fails closed when a plugin that is -- or may be -- contributing to it is broken.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import pluggy

from miles_core import hookspecs
from miles_core.entry_points import entry_points
from miles_core.errors import ActivationError, ConfigError, PluginLoadError
from miles_core.gc_pause import gc_paused

if TYPE_CHECKING:
    import click

ENV_ALLOW = "MILES_PLUGINS"
ENV_DENY = "MILES_DISABLE_PLUGINS"
ENV_ERRORS = "MILES_PLUGIN_ERRORS"
ENV_SLOW_MS = "MILES_PLUGIN_SLOW_MS"
CORE_DISTRIBUTION = "miles"

#: a plugin whose import plus hook calls take longer than this is flagged as slow (every ``miles``
#: command pays for it); ``MILES_PLUGIN_SLOW_MS`` overrides it
DEFAULT_SLOW_MS = 200.0
#: what a plugin that fails to load or verify does: recorded (the plugin is broken), or raised
ErrorPolicy = Literal["record", "raise"]
#: modules discovery must not import (ARCHITECTURE: "discovery is cheap"); a plugin that brings
#: one in while being imported, hooked or cheaply verified is flagged naming it
HEAVY_MODULES = ("torch", "transformers", "ray", "megatron", "e2b", "tensorflow", "jax", "vllm", "sglang", "deepspeed")

#: concern name -> the hook that contributes objects to it
CONCERN_HOOKS: dict[str, str] = {
    "hardware": "miles_hardware_backends",
    "patches": "miles_model_patches",
    "session": "miles_session_versions",
    "sandbox": "miles_sandbox_providers",
    "ci": "miles_ci_hardware",
    "tasks": "miles_tasks",
    "engine": "miles_inference_engines",
    "algorithms": "miles_algorithms",
    "rollout": "miles_rollout_functions",
    "trainer": "miles_trainer_backends",
    "orchestrator": "miles_orchestrators",
    "trackers": "miles_trackers",
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
    #: concern -> "name (by plugin)" for contributions another plugin's higher-priority one replaced
    shadowed: dict[str, list[str]] = field(default_factory=dict)
    #: concern -> contribution name -> "verified" / "failed": its verification in this process
    verification: dict[str, dict[str, str]] = field(default_factory=dict)
    import_ms: float | None = None
    hook_ms: float = 0.0
    #: heavy module -> where this plugin first imported it ("import", "hook miles_tasks", ...)
    heavy_imports: dict[str, str] = field(default_factory=dict)
    slow_ms: float = DEFAULT_SLOW_MS

    @property
    def key(self) -> str:
        """``DIST:NAME``, the plugin's identity (just the name for a plugin without a distribution)."""
        return f"{self.distribution}:{self.name}" if self.distribution else self.name

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

    @property
    def load_ms(self) -> float:
        """What loading this plugin costs every command: its import plus its hook calls."""
        return (self.import_ms or 0.0) + self.hook_ms

    @property
    def slow(self) -> str | None:
        """Why discovering this plugin is slow (measured time and heavy imports), or None."""
        heavy = [f"{m} (at {where})" for m, where in self.heavy_imports.items()]
        if not heavy and self.load_ms <= self.slow_ms:
            return None
        text = f"slow to load: {self.load_ms:.0f} ms (import {self.import_ms or 0:.0f} ms, hooks {self.hook_ms:.0f} ms"
        text += f"; threshold {self.slow_ms:.0f} ms)"
        if heavy:
            text += f"; imports {', '.join(heavy)}, which discovery must not (import it where it is used)"
        return text

    def verified(self, outcome: str | None = "verified") -> dict[str, list[str]]:
        """Concern -> this plugin's contributions whose verification had ``outcome`` here
        (``"verified"``, ``"failed"``, or ``None``: not run in this process)."""
        out: dict[str, list[str]] = {}
        for concern, names in sorted(self.contributes.items()):
            if concern in CONCERN_HOOKS:  # commands have no verify()
                chosen = [n for n in names if self.verification.get(concern, {}).get(n) == outcome]
                if chosen:
                    out[concern] = chosen
        return out

    def broken_for(self, concern: str) -> list[Problem]:
        """Problems that make this plugin unusable for ``concern``.

        Import and registration failures, and a plugin-name conflict (a problem of no concern),
        count for every concern: what the plugin would have contributed is unknown, so activation
        fails closed.
        """
        return [p for p in self.problems if p.stage in ("import", "register") or p.concern in (concern, None)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module_path,
            "builtin": self.builtin,
            "status": self.status,
            "reason": self.reason,
            "hooks": sorted(self.hooks),
            "contributes": {k: v for k, v in sorted(self.contributes.items()) if v},
            "shadowed": {k: v for k, v in sorted(self.shadowed.items()) if v},
            "verified": self.verified(),
            "not_verified": self.verified(None),
            "load": {
                "import_ms": None if self.import_ms is None else round(self.import_ms, 2),
                "hook_ms": round(self.hook_ms, 2),
                "heavy_imports": dict(self.heavy_imports),
                "slow_ms": self.slow_ms,
                "slow": self.slow,
            },
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


def normalize_distribution(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503): ``Miles_QWEN.35`` -> ``miles-qwen-35``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def selects(item: str, record: PluginRecord) -> bool:
    """Whether an allow/deny-list ``item`` names ``record``: ``DIST:NAME`` names exactly that
    plugin; a bare item names every plugin whose entry-point name or distribution it is."""
    distribution = normalize_distribution(record.distribution) if record.distribution else None
    if ":" in item:
        dist, _, name = item.partition(":")
        return name == record.name and distribution == normalize_distribution(dist)
    return item == record.name or normalize_distribution(item) == distribution


def error_policy(value: str) -> ErrorPolicy:
    """``value`` as an :data:`ErrorPolicy` (``MILES_PLUGIN_ERRORS``), or a :class:`ConfigError`."""
    if value == "record":
        return "record"
    if value == "raise":
        return "raise"
    raise ConfigError(f"{ENV_ERRORS} must be 'record' or 'raise', got {value!r}")


class MilesPluginManager:
    """Loads plugins and hands out their contributions, attributed and error-isolated."""

    def __init__(
        self,
        *,
        allow: Iterable[str] | None = None,
        deny: Iterable[str] | None = None,
        errors: ErrorPolicy = "record",
        slow_ms: float = DEFAULT_SLOW_MS,
    ) -> None:
        errors = error_policy(errors)
        self.allow = frozenset(allow) if allow is not None else None
        self.deny = frozenset(deny or ())
        #: the configured policy; :meth:`recording` suspends ``raise`` (listing is diagnostic)
        self.errors = errors
        self.slow_ms = slow_ms
        self._recording = 0
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._records: dict[str, PluginRecord] = {}  # by PluginRecord.key
        self._contributions: dict[str, list[Contribution]] = {}
        self._checked: set[tuple[str, str]] = set()  # (concern, name) run by verify_cheap
        self._applied_patches: dict[str, list[str]] = {}
        self._commands_added = False
        self._lock = threading.RLock()
        self.warnings: list[str] = []

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> MilesPluginManager:
        env = os.environ if environ is None else environ
        errors = error_policy(env.get(ENV_ERRORS, "record").strip().lower() or "record")
        slow = env.get(ENV_SLOW_MS, "").strip()
        try:
            slow_ms = float(slow) if slow else DEFAULT_SLOW_MS
        except ValueError:
            slow_ms = -1.0
        if not slow_ms >= 0:  # also rejects nan
            raise ConfigError(f"{ENV_SLOW_MS} must be a number of milliseconds >= 0, got {slow!r}")
        return cls(
            allow=_parse_list(env.get(ENV_ALLOW)),
            deny=_parse_list(env.get(ENV_DENY)),
            errors=errors,
            slow_ms=slow_ms,
        )

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record every problem inside this block even under ``MILES_PLUGIN_ERRORS=raise``
        (what listing does; :meth:`strict_verdict` says what strict mode decides)."""
        with self._lock:
            self._recording += 1
            try:
                yield
            finally:
                self._recording -= 1

    def strict_verdict(self) -> dict[str, Any]:
        """What ``MILES_PLUGIN_ERRORS=raise`` decides about the plugins as recorded: strict mode
        fails every command that loads plugins as soon as one of them is broken."""
        broken = [r.key for r in self._records.values() if r.status == "broken"]
        return {"policy": self.errors, "passes": not broken, "broken": broken}

    # -- discovery and registration ---------------------------------------------------------

    def _blocked_reason(self, record: PluginRecord) -> str | None:
        if any(selects(item, record) for item in self.deny):
            return f"disabled by {ENV_DENY}"
        if self.allow is not None and not record.builtin and not any(selects(item, record) for item in self.allow):
            return f"not in {ENV_ALLOW}"
        return None

    def _new_record(self, name: str, module_path: str, distribution: str | None, version: str | None,
                    builtin: bool) -> PluginRecord:
        record = PluginRecord(name, module_path, distribution, version, builtin, slow_ms=self.slow_ms)
        record.blocked_reason = self._blocked_reason(record)
        return record

    def discover(self, group: str = hookspecs.ENTRY_POINT_GROUP) -> None:
        """Find, filter, judge name conflicts, then import and register every entry-point plugin.

        The allow/deny lists apply first (a filtered plugin takes no part in conflicts). Then an
        entry-point name declared by more than one distribution among those left is a conflict:
        a built-in's name stays the built-in's (the other is broken), otherwise every plugin of
        that name is broken, none is imported, and each error names all the distributions and
        the ``DIST:NAME`` that picks one. Only then are the remaining plugins imported.
        """
        eps = sorted(
            entry_points(group),
            key=lambda ep: (ep.distribution != CORE_DISTRIBUTION, ep.name, normalize_distribution(ep.distribution or "")),
        )
        # importing plugins builds long-lived objects only: collections here would find nothing
        with self._lock, gc_paused():
            found: list[PluginRecord] = []
            for ep in eps:
                record = self._new_record(ep.name, ep.value, ep.distribution, ep.version,
                                          ep.distribution == CORE_DISTRIBUTION)
                if record.key in self._records or any(r.key == record.key for r in found):
                    self.warnings.append(f"plugin {record.key} is declared twice; the first one found is used")
                    continue
                found.append(record)
            self._judge_name_conflicts(found)
            for record in found:
                self._records[record.key] = record
            self._contributions.clear()
            for record in found:
                if record.problems:
                    self._fail(record)
                elif record.blocked_reason is None:
                    self._import(record)
            self._warn_unknown_filters()

    def _judge_name_conflicts(self, found: list[PluginRecord]) -> None:
        live = [r for r in [*self._records.values(), *found] if r.blocked_reason is None]
        for name in dict.fromkeys(r.name for r in found):
            claimants = [r for r in live if r.name == name]
            if len(claimants) < 2:
                continue
            owner = next((r for r in claimants if r.builtin), None)
            for record in claimants:
                if record is owner or record not in found:
                    continue
                if owner is not None:
                    message = (
                        f"plugin name {name!r} is taken by miles' built-in plugin ({owner.distribution} "
                        f"{owner.version}); this one ({record.module_path}) is not loaded. Rename its entry "
                        f"point, or disable it with {ENV_DENY}={record.key}"
                    )
                else:
                    others = [r for r in claimants if r is not record]
                    declared = "; ".join(
                        f"{r.distribution or 'unknown distribution'} {r.version or '?'} ({r.module_path})"
                        for r in others
                    )
                    message = (
                        f"plugin name {name!r} is also declared by {declared}; none of them is loaded. To "
                        f"load this one ({record.module_path}), disable the other"
                        f"{'s' if len(others) > 1 else ''}: {ENV_DENY}={','.join(r.key for r in others)}"
                    )
                record.problems.append(Problem("conflict", message))

    def _import(self, record: PluginRecord) -> None:
        started, heavy = time.perf_counter(), _heavy_loaded()
        try:
            module = import_object(record.module_path)
        except Exception as exc:  # a broken plugin must not take the CLI down
            record.problems.append(Problem("import", _describe(exc), detail=_traceback()))
            self._fail(record)
            return
        finally:
            record.import_ms = (time.perf_counter() - started) * 1000
            _note_heavy(record, heavy, "import")
        self._register_module(record, module)

    def register(
        self,
        plugin: ModuleType | object,
        *,
        name: str,
        distribution: str | None = None,
        version: str | None = None,
        builtin: bool = False,
    ) -> PluginRecord:
        """Register an already-imported plugin object (used by tests and embedding code).

        Raises ``ValueError`` if a plugin of this key, or a loaded plugin of this name, exists.
        """
        with self._lock:
            module_path = getattr(plugin, "__name__", type(plugin).__name__)
            record = self._new_record(name, module_path, distribution, version, builtin)
            if record.key in self._records:
                raise ValueError(f"a plugin {record.key!r} is already registered")
            if record.blocked_reason is None:
                for other in self._records.values():
                    if other.name == name and other.blocked_reason is None:
                        raise ValueError(f"a plugin named {name!r} is already registered: {other.label}")
            self._records[record.key] = record
            if record.blocked_reason is None:
                self._register_module(record, plugin)
            self._contributions.clear()
            return record

    def _register_module(self, record: PluginRecord, module: ModuleType | object) -> None:
        record.module = module
        try:
            hash(module)
        except TypeError:  # pluggy keeps plugins in sets (subset_hook_caller): register a hashable view
            module = _hashable_view(module, record.name)
        try:
            self._pm.register(module, name=record.key)  # pluggy checks signatures against the specs
        except Exception as exc:
            record.problems.append(Problem("register", _describe(exc), detail=_traceback()))
            self._fail(record)
            return
        record.hooks = sorted(hc.name for hc in self._pm.get_hookcallers(module) or [])
        try:
            # every plugin registered before this one passed, so a failure here is this one's
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            unknown = [
                hc.name
                for hc in self._pm.get_hookcallers(module) or []
                if not hc.has_spec() and any(not i.optionalhook for i in hc.get_hookimpls() if i.plugin is module)
            ]
            self._pm.unregister(module)
            record.hooks = []
            record.problems.append(
                Problem("register", f"implements unknown hook(s) {', '.join(unknown)} ({exc})")
            )
            self._fail(record)

    def _warn_unknown_filters(self) -> None:
        records = list(self._records.values())
        for var, items in ((ENV_ALLOW, self.allow or frozenset()), (ENV_DENY, self.deny)):
            for unknown in sorted(i for i in items if not any(selects(i, r) for r in records)):
                self.warnings.append(f"{var} names {unknown!r}, which is not an installed plugin")

    def _fail(self, record: PluginRecord) -> None:
        if self.errors == "raise" and not self._recording:
            raise PluginLoadError(f"plugin {record.label} is broken: {record.reason}")

    # -- queries ----------------------------------------------------------------------------

    def plugins(self) -> list[PluginRecord]:
        return list(self._records.values())

    def get(self, name: str) -> PluginRecord:
        """The plugin ``name`` names: its key (``DIST:NAME``), or an entry-point or distribution
        name that names exactly one plugin. ``KeyError`` if none; :class:`ConfigError` listing
        the keys if several."""
        if name in self._records:
            return self._records[name]
        matches = [r for r in self._records.values() if selects(name, r)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise KeyError(name)
        keys = ", ".join(r.key for r in matches)
        raise ConfigError(f"{name!r} names {len(matches)} plugins ({keys}); name one as DIST:NAME")

    def selector(self, record: PluginRecord) -> str:
        """The shortest allow/deny-list item that names ``record`` alone: its name, else its key."""
        if sum(selects(record.name, r) for r in self._records.values()) == 1:
            return record.name
        return record.key

    def contributions(self, concern: str) -> list[Contribution]:
        """Every object contributed to ``concern`` by plugins that are not blocked.

        The hook is called once per plugin through pluggy's hook caller (see :meth:`_each_plugin`);
        a plugin whose call raises or returns something malformed is marked broken for the
        concern and contributes nothing, while every other plugin's contributions still arrive.

        Two plugins contributing the same name: the one whose implementation pluggy orders first
        by priority (``tryfirst`` over plain over ``trylast``) replaces the other, which is
        recorded as *shadowed* (not a problem: the order was asked for). At equal priority the
        clash is a conflict: the plugin registered later is broken for the concern. Contributions
        are listed highest priority first, then in registration order.
        """
        if concern not in CONCERN_HOOKS:
            raise ValueError(f"unknown concern {concern!r}; known: {', '.join(CONCERN_HOOKS)}")
        with self._lock:
            if concern in self._contributions:
                return list(self._contributions[concern])
            hook_name = CONCERN_HOOKS[concern]
            offered: list[tuple[int, int, PluginRecord, list[Any]]] = []
            for record, results in self._each_plugin(hook_name, concern):
                if results is None:
                    continue
                try:
                    objects = _validate_contributions(results, hook_name)
                except Exception as exc:
                    record.problems.append(Problem("hook", f"{hook_name} {exc}", concern, _traceback()))
                    self._fail(record)
                    continue
                position = list(self._records.values()).index(record)
                offered.append((-self._priority(hook_name, record), position, record, objects))
            seen: dict[str, tuple[int, Contribution]] = {}
            out: list[Contribution] = []
            for rank, _, record, objects in sorted(offered, key=lambda o: o[:2]):
                names: list[str] = []
                for obj in objects:
                    if obj.name in seen:
                        first_rank, first = seen[obj.name]
                        if first_rank < rank:
                            record.shadowed.setdefault(concern, []).append(f"{obj.name} (by {first.plugin.name})")
                            continue
                        record.problems.append(
                            Problem(
                                "conflict",
                                f"{concern} {obj.name!r} is already provided by plugin {first.plugin.label}"
                                " (give one implementation tryfirst=True to replace the other on purpose)",
                                concern,
                            )
                        )
                        self._fail(record)
                        continue
                    contribution = Contribution(concern, obj.name, obj, record)
                    seen[obj.name] = (rank, contribution)
                    out.append(contribution)
                    names.append(obj.name)
                record.contributes[concern] = names
            self._contributions[concern] = out
            return list(out)

    def _priority(self, hook_name: str, record: PluginRecord) -> int:
        """2 for a ``tryfirst`` implementation, 0 for ``trylast``, 1 otherwise."""
        for impl in getattr(self._pm.hook, hook_name).get_hookimpls():
            if impl.plugin_name == record.key and not (impl.wrapper or impl.hookwrapper):
                return 2 if impl.tryfirst else 0 if impl.trylast else 1
        return 1

    def _each_plugin(
        self, hook_name: str, concern: str, **kwargs: object
    ) -> Iterator[tuple[PluginRecord, list[Any] | None]]:
        """Call ``hook_name`` once per implementing plugin, in pluggy's call order, through a
        subset of pluggy's own hook caller that holds that plugin's implementation and every
        wrapper (``wrapper=True`` / ``hookwrapper=True``) of the hook.

        So ``tryfirst``/``trylast`` order the calls and wrappers wrap each one, as pluggy
        defines them, while each result stays attributed to the one plugin that made it (a
        wrapper sees and may change that plugin's result list). An exception is blamed on the
        implementation whose frame it passed through: the plugin's own (that plugin is broken for
        the concern), else the wrapper that raised it (that wrapper's plugin is broken for the
        concern and left out of the remaining calls, and the call is made again without it).
        Yields ``(record, results)`` where ``results`` is pluggy's list of return values, or
        ``None`` when the plugin's call failed (the problem is recorded by then).
        """
        impls = getattr(self._pm.hook, hook_name).get_hookimpls()
        wrappers = [i for i in impls if i.wrapper or i.hookwrapper]
        order: list[object] = []
        for impl in reversed(impls):  # pluggy calls its list back to front
            if not (impl.wrapper or impl.hookwrapper) and impl.plugin not in order:
                order.append(impl.plugin)
        dropped: list[object] = []
        for plugin in order:
            record = self._records[_plugin_name(impls, plugin)]
            own = [i for i in impls if i.plugin is plugin and not (i.wrapper or i.hookwrapper)]
            while True:
                others = [p for p in order if p is not plugin] + dropped
                started, heavy = time.perf_counter(), _heavy_loaded()
                error: Exception | None = None
                try:
                    results = self._pm.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)
                except Exception as exc:
                    error, detail = exc, _traceback()
                record.hook_ms += (time.perf_counter() - started) * 1000
                _note_heavy(record, heavy, f"hook {hook_name}")
                if error is None:
                    yield record, results
                    break
                live = [w for w in wrappers if w.plugin not in dropped]
                wrapper = None if _passed_through(error, own) else _innermost(error, live)
                if wrapper is None:
                    record.problems.append(Problem("hook", f"{hook_name} raised {_describe(error)}", concern, detail))
                    self._fail(record)
                    yield record, None
                    break
                culprit = self._records[wrapper.plugin_name]
                culprit.problems.append(
                    Problem("hook", f"{hook_name} wrapper raised {_describe(error)}", concern, detail)
                )
                self._fail(culprit)
                dropped.append(wrapper.plugin)

    def collect_all(self) -> None:
        """Call every contribution hook once (what ``miles plugins list`` shows)."""
        for concern in CONCERN_HOOKS:
            self.contributions(concern)

    def verify_cheap(self) -> None:
        """Run, once, the ``verify()`` of every contribution that declares ``cheap_verify = True``
        (what listing runs; the others are reported as not verified -- ``miles doctor`` verifies
        everything). A failure is recorded against the plugin like any verification failure."""
        self.collect_all()
        with self._lock:
            for concern in CONCERN_HOOKS:
                for contribution in self._contributions[concern]:
                    if (concern, contribution.name) in self._checked or getattr(contribution.obj, "cheap_verify", False) is not True:
                        continue
                    self._checked.add((concern, contribution.name))
                    record, heavy = contribution.plugin, _heavy_loaded()
                    with contextlib.suppress(ActivationError):  # recorded by verify()
                        self.verify(contribution, contribution.obj.verify)
                    _note_heavy(record, heavy, f"verify of {concern} {contribution.name!r}")

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
            names = ",".join(self.selector(record) for record, _ in broken)
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
        record = contribution.plugin
        outcomes = record.verification.setdefault(contribution.concern, {})
        try:
            result = check(*args, **kwargs)
        except Exception as exc:
            outcomes[contribution.name] = "failed"
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
        outcomes.setdefault(contribution.name, "verified")  # a failure earlier in the process stands
        return result

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
            before = dict(cli.commands)
            for record, results in self._each_plugin("miles_commands", "commands", cli=cli):
                if results is None:  # its hook raised: drop whatever it added before raising
                    cli.commands.clear()
                    cli.commands.update(before)
                    continue
                clobbered = [n for n, cmd in before.items() if cli.commands.get(n) is not cmd]
                if clobbered:
                    record.problems.append(
                        Problem(
                            "conflict",
                            f"miles_commands tried to replace command(s) {', '.join(clobbered)}",
                            "commands",
                        )
                    )
                    cli.commands.clear()
                    cli.commands.update(before)
                    self._fail(record)
                    continue
                record.contributes["commands"] = sorted(set(cli.commands) - set(before))
                before = dict(cli.commands)


def fingerprint_mismatch(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they match)."""
    if expected.get("digest") == actual.get("digest"):
        return []
    diffs: list[str] = []
    exp_plugins = {(p[0], p[1]): p for p in expected.get("plugins", [])}
    act_plugins = {(p[0], p[1]): p for p in actual.get("plugins", [])}
    keys = exp_plugins.keys() | act_plugins.keys()
    for key in sorted(keys, key=lambda k: (k[0], k[1] or "")):
        if exp_plugins.get(key) != act_plugins.get(key):
            name, dist = key
            shown = name if sum(k[0] == name for k in keys) == 1 else f"{dist}:{name}"
            diffs.append(f"plugin {shown}: expected {exp_plugins.get(key)}, found {act_plugins.get(key)}")
    exp_patches = expected.get("applied_patches", {})
    act_patches = actual.get("applied_patches", {})
    for name in sorted(exp_patches.keys() | act_patches.keys()):
        if exp_patches.get(name) != act_patches.get(name):
            diffs.append(f"patch {name}: expected {exp_patches.get(name)}, found {act_patches.get(name)}")
    return diffs or ["fingerprint digests differ"]


def _validate_contributions(results: list[Any], hook_name: str) -> list[Any]:
    """The objects of one plugin's call; ``results`` is pluggy's list of its return values
    (pluggy leaves out ``None``, so an empty list means the implementation returned ``None``)."""
    if not results:
        raise TypeError("returned None; return a list (possibly empty)")
    objects: list[Any] = []
    for result in results:
        if isinstance(result, (str, bytes)) or not isinstance(result, (list, tuple)):
            raise TypeError(f"must return a list, got {type(result).__name__}")
        objects.extend(result)
    for obj in objects:
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"returned {obj!r} without a non-empty str 'name'")
        if not callable(getattr(obj, "verify", None)):
            raise TypeError(f"returned {name!r} without a callable verify()")
    return objects


def _hashable_view(plugin: object, name: str) -> ModuleType:
    """A module holding ``plugin``'s public attributes (its hook implementations among them)."""
    view = ModuleType(getattr(plugin, "__name__", name))
    for attr in dir(plugin):
        if not attr.startswith("__"):
            setattr(view, attr, getattr(plugin, attr))
    return view


def _plugin_name(impls: Iterable[pluggy.HookImpl], plugin: object) -> str:
    return next(i.plugin_name for i in impls if i.plugin is plugin)


def _passed_through(exc: BaseException, impls: Iterable[pluggy.HookImpl]) -> bool:
    """Whether ``exc`` propagated through a frame of one of ``impls`` (it raised there or below)."""
    codes = {getattr(i.function, "__code__", None) for i in impls}
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False


def _innermost(exc: BaseException, impls: Iterable[pluggy.HookImpl]) -> pluggy.HookImpl | None:
    """The implementation among ``impls`` whose frame is deepest in ``exc``'s traceback."""
    by_code = {getattr(i.function, "__code__", None): i for i in impls}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        found = by_code.get(tb.tb_frame.f_code, found)
        tb = tb.tb_next
    return found


def _traceback() -> str:
    import traceback  # only on the error path: it pulls in linecache and tokenize

    return traceback.format_exc()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _heavy_loaded() -> frozenset[str]:
    return frozenset(m for m in HEAVY_MODULES if m in sys.modules)


def _note_heavy(record: PluginRecord, before: frozenset[str], where: str) -> None:
    """Blame ``record`` for every heavy module that appeared since ``before`` was taken."""
    for module in sorted(_heavy_loaded() - before):
        record.heavy_imports.setdefault(module, where)


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


def listing_plugin_manager() -> MilesPluginManager:
    """The manager ``miles plugins list|show`` report on: the process-wide one if it exists, else
    a fresh one from the environment discovered inside :meth:`MilesPluginManager.recording`
    (not installed process-wide). Listing is diagnostic: under ``MILES_PLUGIN_ERRORS=raise`` it
    still lists everything and shows strict mode's verdict instead of stopping at the first error.
    """
    with _manager_lock:
        if _manager is not None:
            return _manager
    manager = MilesPluginManager.from_environment()
    with manager.recording():
        manager.discover()
    return manager


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
