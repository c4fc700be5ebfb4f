"""``miles doctor``: activate every concern and report what was selected, applied and verified.

Each concern contributes one check function ``check(pm) -> list[CheckResult]``, listed in
:data:`CONCERN_CHECKS` and imported only when the doctor runs. A check that raises is reported as
a failed, required result carrying the error text; the doctor never hides an exception.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from miles_core.hardware.autotuning import first_config_autotuning
from miles_core.plugins import MilesPluginManager, import_object

#: ``warn``: worth the user's attention, never fails the doctor (a slow plugin, a replaced built-in)
Status = Literal["ok", "fail", "skip", "info", "warn"]

#: (concern, "module:function"), run in this order
CONCERN_CHECKS: tuple[tuple[str, str], ...] = (
    ("plugins", "miles_core.doctor:check_plugins"),
    ("hardware", "miles_core.hardware.doctor:check"),
    ("patches", "miles_core.patches.doctor:check"),
    ("sandbox", "miles_core.sandbox.doctor:check"),
    ("ci", "miles_core.ci.doctor:check"),
    ("session", "miles_core.session.doctor:check"),
    ("engine", "miles_core.engine.doctor:check"),
    ("train", "miles_core.rl.doctor:check"),
)


@dataclass
class CheckResult:
    concern: str
    item: str
    status: Status
    detail: str = ""
    required: bool = True
    plugin: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.required and self.status == "fail"


@dataclass
class DoctorReport:
    results: list[CheckResult]
    fingerprint: dict[str, Any]
    seconds: float
    #: wall time of each concern's checks, in the order they ran (where a slow doctor spends it)
    concern_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(r.failed for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "results": [asdict(r) for r in self.results],
            "fingerprint": self.fingerprint,
            "seconds": round(self.seconds, 3),
            "concern_seconds": {k: round(v, 3) for k, v in self.concern_seconds.items()},
        }


#: a plugin record's status -> its check's status
PLUGIN_STATUS: dict[str, Status] = {"ok": "ok", "broken": "fail", "blocked": "skip"}


def check_plugins(pm: MilesPluginManager) -> list[CheckResult]:
    """Every installed plugin loads and registers; broken ones fail the doctor, slow ones (load
    time over the threshold, or a heavy import at discovery) are flagged with the measured time."""
    pm.collect_all()
    results = []
    for record in pm.plugins():
        status = PLUGIN_STATUS[record.status]
        detail = record.reason or f"{record.distribution} {record.version}"
        item = pm.selector(record)
        results.append(CheckResult("plugins", item, status, detail, plugin=record.name))
        if record.slow and record.status != "blocked":
            load = record.to_dict()["load"]
            results.append(CheckResult("plugins", f"{item} load time", "warn", record.slow, required=False,
                                       plugin=record.name, data={k: load[k] for k in ("import_ms", "hook_ms", "heavy_imports")}))
    for warning in pm.warnings:
        results.append(CheckResult("plugins", "filters", "info", warning, required=False))
    return results


#: called after each concern's checks: (concern, its results, its wall seconds)
ConcernDone = Callable[[str, list[CheckResult], float], None]


def run_doctor(pm: MilesPluginManager, concerns: tuple[str, ...] | None = None, *,
               on_concern: ConcernDone | None = None) -> DoctorReport:
    """Run the checks of every concern (or of ``concerns``), in :data:`CONCERN_CHECKS` order;
    ``on_concern`` sees each concern's results as soon as they exist (a GPU doctor can take minutes)."""
    started = time.perf_counter()
    results: list[CheckResult] = []
    seconds: dict[str, float] = {}
    # the checks need correct kernels, not the fastest: autotuning on a fresh GPU machine compiled
    # every config of every fla kernel (minutes of a cold doctor)
    with first_config_autotuning():
        for concern, path in CONCERN_CHECKS:
            if concerns is not None and concern not in concerns:
                continue
            concern_started = time.perf_counter()
            try:
                found = list(import_object(path)(pm))
            except Exception as exc:
                detail = f"{type(exc).__name__}: {exc}"
                found = [CheckResult(concern, "activation", "fail", detail, data={"traceback": traceback.format_exc()})]
            seconds[concern] = time.perf_counter() - concern_started
            results.extend(found)
            if on_concern is not None:
                on_concern(concern, found, seconds[concern])
    return DoctorReport(results, pm.fingerprint(), time.perf_counter() - started, seconds)
