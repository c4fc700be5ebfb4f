"""The `miles` CLI: version, plugins list/show, doctor exit codes, plugin commands, error mapping."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import click
import pytest

from miles_core import __version__
from miles_core.ci.register import register_cpu_ci
from miles_core.cli import cli, main
from miles_core.testing import plugin_module

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@dataclass
class Gadget:
    name: str
    ok: bool = True

    def verify(self) -> None:
        if not self.ok:
            raise RuntimeError("gadget is not wired")


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_version(capsys) -> None:
    code, out, _ = run(["--version"], capsys)
    assert (code, out.strip()) == (0, f"miles {__version__}")


def test_plugins_list_json_is_one_document(miles_pm, capsys) -> None:
    def boom() -> list[Gadget]:
        raise ImportError("sdk missing")

    miles_pm.register(
        plugin_module("a", miles_tasks=lambda: [Gadget("t1")]),
        name="alpha",
        distribution="alpha-dist",
        version="2.0",
    )
    miles_pm.register(plugin_module("b", miles_tasks=boom), name="beta")
    code, out, _ = run(["plugins", "list", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    by_name = {p["name"]: p for p in doc["plugins"]}
    assert by_name["alpha"]["status"] == "ok"
    assert by_name["alpha"]["version"] == "2.0"
    assert by_name["alpha"]["distribution"] == "alpha-dist"
    assert by_name["alpha"]["hooks"] == ["miles_tasks"]
    assert by_name["alpha"]["contributes"] == {"tasks": ["t1"]}
    assert by_name["beta"]["status"] == "broken"
    assert "ImportError: sdk missing" in by_name["beta"]["reason"]


def test_plugins_list_table(miles_pm, capsys) -> None:
    miles_pm.register(plugin_module("a", miles_tasks=lambda: [Gadget("t1")]), name="alpha")
    code, out, _ = run(["plugins", "list"], capsys)
    assert code == 0 and "alpha" in out and "tasks: t1" in out


def test_plugins_show_and_unknown_name(miles_pm, capsys) -> None:
    miles_pm.register(plugin_module("a", miles_tasks=lambda: [Gadget("t1")]), name="alpha")
    code, out, _ = run(["plugins", "show", "alpha", "--json"], capsys)
    assert code == 0 and json.loads(out)["contributes"] == {"tasks": ["t1"]}
    code, _, err = run(["plugins", "show", "nope"], capsys)
    assert code == 2
    assert "no plugin named 'nope' (installed: alpha)" in err


def test_doctor_exit_code_follows_broken_plugins(miles_pm_factory, capsys) -> None:
    pm = miles_pm_factory()
    pm.register(plugin_module("a", miles_tasks=lambda: [Gadget("t1")]), name="alpha")
    code, out, _ = run(["doctor", "--json"], capsys)
    assert code == 0, out
    assert json.loads(out)["ok"] is True

    def boom() -> list[Gadget]:
        raise RuntimeError("cannot register")

    pm = miles_pm_factory()
    pm.register(plugin_module("b", miles_tasks=boom), name="beta")
    code, out, _ = run(["doctor", "--json"], capsys)
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    failed = [r for r in report["results"] if r["status"] == "fail"]
    assert [(r["item"], "RuntimeError: cannot register" in r["detail"]) for r in failed] == [("beta", True)]


def test_plugins_add_commands_but_cannot_shadow_core(miles_pm, capsys) -> None:
    @click.command("hello")
    def hello() -> None:
        click.echo("hello from a plugin")

    @click.command("doctor")
    def fake_doctor() -> None:
        click.echo("hijacked")

    miles_pm.register(plugin_module("p", miles_commands=lambda cli: cli.add_command(hello)), name="greeter")
    miles_pm.register(
        plugin_module("q", miles_commands=lambda cli: cli.add_command(fake_doctor)), name="hijacker"
    )
    try:
        code, out, _ = run(["hello"], capsys)
        assert (code, out.strip()) == (0, "hello from a plugin")
        assert "replace command(s) doctor" in miles_pm.get("hijacker").reason
        assert cli.commands["doctor"] is not fake_doctor
    finally:
        cli.commands.pop("hello", None)


def test_help_lists_core_commands_without_heavy_imports() -> None:
    code = (
        "import sys\n"
        "from miles_core.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'ray', 'megatron', 'e2b') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "plugins" in out and "doctor" in out
    assert "HEAVY []" in out


def test_doctor_reports_each_concern_as_it_finishes_with_its_time(miles_pm_factory, capsys, monkeypatch) -> None:
    """A GPU doctor can take minutes: each concern's block is printed when its checks finish (not
    all at the end), headed by its wall time; --json carries the same times per concern."""
    import time

    from miles_core import doctor as doctor_module

    pm = miles_pm_factory()
    pm.register(plugin_module("a", miles_tasks=lambda: [Gadget("t1")]), name="alpha")
    printed_before: dict[str, str] = {}

    def slow_check(concern: str, delay: float):
        def check(_pm) -> list:
            printed_before[concern] = capsys.readouterr().out  # what the CLI had printed when this ran
            time.sleep(delay)
            return [doctor_module.CheckResult(concern, f"{concern} item", "ok", "fine")]
        return check

    checks = {"first": slow_check("first", 0.3), "second": slow_check("second", 0.0)}
    monkeypatch.setattr(doctor_module, "CONCERN_CHECKS", (("first", "x:first"), ("second", "x:second")))
    monkeypatch.setattr(doctor_module, "import_object", lambda path: checks[path.split(":")[1]])
    code, out, _ = run(["doctor"], capsys)
    assert code == 0
    assert printed_before["first"] == "" and "first item" in printed_before["second"]  # streamed
    first_header = next(line for line in printed_before["second"].splitlines() if line.startswith("first"))
    assert 0.3 <= float(first_header.split("(")[1].split(" s")[0]) < 5
    code, out, _ = run(["doctor", "--json"], capsys)
    seconds = json.loads(out)["concern_seconds"]
    assert list(seconds) == ["first", "second"] and seconds["first"] >= 0.3 > seconds["second"]
