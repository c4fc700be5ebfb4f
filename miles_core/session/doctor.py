"""Doctor check for the session concern: every registered version passes its conformance suite,
and the server's dependencies import."""

from __future__ import annotations

from importlib import metadata
from importlib.util import find_spec

from miles_core.doctor import CheckResult
from miles_core.errors import ActivationError
from miles_core.plugins import MilesPluginManager

#: distribution -> module the session server imports on activation
SERVER_DEPENDENCIES = {
    "uvicorn": "uvicorn",
    "httptools": "httptools",
    "orjson": "orjson",
    "httpx": "httpx",
    "h11": "h11",
    "pydantic": "pydantic",
    "transformers": "transformers",
    "jinja2": "jinja2",
}


def check(pm: MilesPluginManager) -> list[CheckResult]:
    results = []
    for contribution in pm.active_contributions("session"):
        try:
            passed = pm.verify(contribution, contribution.obj.verify)
        except ActivationError as exc:
            results.append(CheckResult("session", f"version {contribution.name}", "fail", str(exc), plugin=contribution.plugin.name))
            continue
        count = f"{len(passed)} conformance checks passed" if isinstance(passed, list) else "verified"
        results.append(CheckResult("session", f"version {contribution.name}", "ok", count, plugin=contribution.plugin.name))
    if not results:
        results.append(
            CheckResult("session", "versions", "skip", "no session version is registered", required=False)
        )
    missing = [distribution for distribution, module in SERVER_DEPENDENCIES.items() if find_spec(module) is None]
    if missing:
        results.append(CheckResult("session", "server dependencies", "fail", f"not installed: {', '.join(missing)}"))
    else:
        versions = ", ".join(f"{d} {metadata.version(d)}" for d in SERVER_DEPENDENCIES)
        results.append(CheckResult("session", "server dependencies", "ok", versions))
    return results
