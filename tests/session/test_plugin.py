"""Session versions as plugins: the built-in registration, cheap discovery, a third-party version
served without touching core, fail-closed activation, and the doctor check."""

import json
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.doctor import run_doctor
from miles_core.errors import ActivationError, ConfigError, PluginLoadError
from miles_core.hookspecs import hookimpl
from miles_core.plugins import MilesPluginManager
from miles_core.session.config import SessionServerConfig
from miles_core.session.embed import serve_in_thread
from miles_core.session.server import activate_version
from miles_core.session.versions import LinearVersion
from miles_core.testing.engine_stub import ScriptedChat, StubEngine
from miles_core.testing.isolation import register_builtins

register_cpu_ci(est_time=7, suite="stage-a-cpu")


def _plugin(*versions):
    @hookimpl
    def miles_session_versions():
        return list(versions)

    return SimpleNamespace(miles_session_versions=miles_session_versions)


@dataclass(frozen=True)
class DeepRollback(LinearVersion):
    name: str = "v1-deep"
    max_rollback: int = 3


@dataclass(frozen=True)
class Unverifiable(LinearVersion):
    name: str = "v-bad"

    def verify(self) -> list[str]:
        raise RuntimeError("store lost a record")


def test_builtin_plugin_is_discovered() -> None:
    pm = MilesPluginManager()
    pm.discover()
    record = pm.get("core-session")
    assert record.builtin and record.distribution == "miles" and record.status == "ok", record.reason
    assert record.module_path == "miles_core.session.builtin"
    assert [c.name for c in pm.contributions("session") if c.plugin is record] == ["v1", "v2"]


def test_discovery_and_cli_import_stay_cheap() -> None:
    code = (
        "import sys, miles_core.session.builtin as b, miles_core.session.cli\n"
        "b.miles_session_versions()\n"
        "heavy = ['torch', 'transformers', 'httpx', 'httptools', 'orjson', 'starlette', 'uvicorn', 'pydantic', 'fastapi', 'h11', 'jinja2']\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "from miles_core.session import SessionServerConfig, build_app, serve_in_thread\n"
        "print(callable(serve_in_thread) and callable(build_app) and SessionServerConfig.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "SessionServerConfig"]


def test_third_party_version_is_served(tokenizer_dir, chat_tokenizer) -> None:
    pm = _manager_with(DeepRollback())
    with StubEngine(ScriptedChat(chat_tokenizer)) as stub:
        config = SessionServerConfig(upstream_url=stub.url, tokenizer_dir=tokenizer_dir, version="v1-deep")
        with serve_in_thread(config, pm=pm, tokenizer=chat_tokenizer) as url, httpx.Client(base_url=url) as client:
            assert client.get("/health").json()["version"] == "v1-deep"
            sid = client.post("/sessions").json()["session_id"]
            history = []
            for text in ("one", "two", "three"):
                history.append({"role": "user", "content": text})
                reply = client.post(f"/sessions/{sid}/v1/chat/completions", content=json.dumps({"messages": history}))
                history.append(reply.json()["choices"][0]["message"])
            # discarding two generated turns: refused by v1, allowed by this version
            deep = client.post(f"/sessions/{sid}/v1/chat/completions", content=json.dumps({"messages": history[:1]}))
            assert deep.status_code == 200, deep.text
            assert len(client.get(f"/sessions/{sid}").json()["records"]) == 1


def _manager_with(*versions) -> MilesPluginManager:
    pm = MilesPluginManager()
    register_builtins(pm)
    pm.register(_plugin(*versions), name="acme-sessions", distribution="acme", version="1.0")
    return pm


def test_activation_fails_closed_naming_the_plugin() -> None:
    pm = _manager_with(Unverifiable())
    with pytest.raises(ActivationError) as info:
        activate_version("v-bad", pm)
    message = str(info.value)
    for part in ("acme-sessions", "acme 1.0", "'v-bad'", "store lost a record"):
        assert part in message
    with pytest.raises(PluginLoadError, match="MILES_DISABLE_PLUGINS=acme-sessions"):
        activate_version("v2", pm)  # the concern now fails closed until the plugin is excluded
    with pytest.raises(ConfigError, match=r"no session named 'v9'.*known: v-bad, v1, v2"):
        activate_version("v9", _manager_with(Unverifiable()))
    assert activate_version("v2", _manager_with(Unverifiable())).name == "v2"


def test_doctor_reports_each_version() -> None:
    pm = MilesPluginManager()
    register_builtins(pm)
    report = run_doctor(pm, ("session",))
    assert report.ok
    items = {r.item: r for r in report.results}
    assert items["version v1"].status == "ok" and "conformance checks passed" in items["version v1"].detail
    assert items["server dependencies"].status == "ok"
    report = run_doctor(_manager_with(Unverifiable()), ("session",))
    assert not report.ok
    bad = {r.item: r for r in report.results}["version v-bad"]
    assert bad.status == "fail" and "acme-sessions" in bad.detail
