"""Sessions served in this process (what `miles train`'s agentic rollout uses) do not import the
HTTP transport: no session server, engine client, engine HTTP server or httpx."""

from __future__ import annotations

import json
import subprocess
import sys

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")

TRANSPORT = ("httpx", "starlette", "miles_core.session.server", "miles_core.engine.client", "miles_core.engine.server")


def test_the_in_process_session_path_imports_no_transport() -> None:
    probe = (
        "import json, sys\n"
        "import miles_core.session.client, miles_core.session.service, miles_core.session.upstream\n"
        "from miles_core.session.service import activate_version\n"
        "from miles_core.engine.errors import EngineError\n"
        f"print(json.dumps([m for m in {TRANSPORT!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == []


def test_the_transport_modules_still_offer_what_moved() -> None:
    from miles_core.engine import client, errors
    from miles_core.session import server as session_server
    from miles_core.session import service

    assert client.EngineError is errors.EngineError and client.EngineHTTPError is errors.EngineHTTPError
    assert session_server.activate_version is service.activate_version
