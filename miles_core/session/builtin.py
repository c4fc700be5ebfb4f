"""Built-in plugin ``core-session``: registers session versions v1 (linear) and v2 (tree)."""

from __future__ import annotations

from miles_core.hookspecs import hookimpl
from miles_core.session.versions import LinearVersion, TreeVersion


@hookimpl
def miles_session_versions() -> list[object]:
    return [LinearVersion(), TreeVersion()]
