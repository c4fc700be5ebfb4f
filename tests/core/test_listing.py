"""`miles plugins list|show` and `miles doctor` always work and say what they see: plugin text shown
verbatim (never read as rich markup), strict mode's verdict, what was and was not verified, slow
plugins flagged with their measured time, a built-in hardware backend replaced by a plugin's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_core.ci.register import register_cpu_ci
from miles_core.cli import main
from miles_core.cli._output import visible
from miles_core.doctor import CheckResult, DoctorReport, run_doctor
from miles_core.entry_points import EntryPointInfo
from miles_core.plugins import MilesPluginManager
from miles_core.testing import isolated_plugin_manager, plugin_module
from miles_core.testing.hardware import no_active_hardware  # noqa: F401 (autouse: no backend leaks)

register_cpu_ci(est_time=7, suite="stage-a-cpu")


@dataclass
class Task:
    name: str
    fail_with: str | None = None
    cheap_verify: bool = True

    def verify(self) -> None:
        if self.fail_with is not None:
            raise RuntimeError(self.fail_with)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables one line per row, so text can be looked for verbatim."""
    monkeypatch.setenv("COLUMNS", "4000")


def raising(message: str):
    def miles_tasks() -> list[Task]:
        raise RuntimeError(message)

    return miles_tasks


# -- plugin text is shown verbatim ------------------------------------------------------------


def test_markup_in_a_plugins_error_is_shown_not_parsed(miles_pm, capsys, wide) -> None:
    message = "closing tag [/] and [red]not red[/red] and :smile: and pip install 'miles[train]'"
    miles_pm.register(plugin_module("b", miles_tasks=raising(message)), name="markup-victim")
    for argv in (["plugins", "list"], ["plugins", "show", "markup-victim"]):
        code, out, err = run(argv, capsys)
        assert code == 0, err
        assert f"RuntimeError: {message}" in out


def test_doctor_shows_extras_and_plugin_text_verbatim(capsys, wide) -> None:
    from miles_core.cli._output import console
    from miles_core.cli.doctor_cmd import render_report

    report = DoctorReport(
        [
            CheckResult("train", "module transformers", "fail", "missing: pip install 'miles[train]'"),
            CheckResult("plugins", "[bold]x[/]", "warn", "a [/] b", data={"k": "[dim]v"}),
        ],
        {"digest": "0" * 64},
        0.1,
    )
    render_report(report, console())
    out = capsys.readouterr().out
    assert "pip install 'miles[train]'" in out
    assert "[bold]x[/]" in out and "a [/] b" in out and "k: [dim]v" in out


def test_terminal_control_in_plugin_text_is_escaped(miles_pm, capsys, wide) -> None:
    miles_pm.register(plugin_module("b", miles_tasks=raising("\x1b[2Jclear \u202eevil\nnext")), name="ansi")
    code, out, _ = run(["plugins", "list"], capsys)
    assert code == 0
    assert "\x1b[2J" not in out and "\u202e" not in out
    assert "\\x1b[2Jclear \\u202eevil\\nnext" in out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=40))
def test_any_plugin_text_is_listed_shown_and_doctored_verbatim(text: str, capsys, wide) -> None:
    """Whatever a plugin's name, distribution, version, contribution or error says, listing,
    showing and the doctor's report never crash and show it as :func:`visible` writes it."""
    with isolated_plugin_manager() as pm:
        pm.register(plugin_module("n", miles_tasks=lambda: [Task(text, cheap_verify=False)]),
                    name=text, distribution=f"d{text}", version=text)
        pm.register(plugin_module("e", miles_tasks=raising(text)), name="errs")
        key = f"d{text}:{text}"
        shown = visible(text)
        error = visible(f"RuntimeError: {text.strip()}" if text.strip() else "RuntimeError")
        code, out, err = run(["plugins", "list"], capsys)
        assert code == 0, err
        assert shown in out and error in out
        code, out, err = run(["plugins", "show", "--", key], capsys)
        assert code == 0, err
        assert visible(f"tasks: {text} (not verified)") in out and visible(f"d{text} {text}") in out
        code, out, err = run(["plugins", "list", "--json"], capsys)
        assert code == 0 and {p["name"] for p in json.loads(out)["plugins"]} == {text, "errs"}

        from miles_core.cli._output import console
        from miles_core.cli.doctor_cmd import render_report

        report = run_doctor(pm, concerns=("plugins",))
        report.results.append(CheckResult("train", text, "fail", text, data={text: text}))
        render_report(report, console())
        out = capsys.readouterr().out
        assert error in out and visible(f"{text}: {text}") in out


# -- strict mode: listing lists and gives the verdict -----------------------------------------


def test_strict_mode_lists_everything_and_gives_its_verdict(miles_pm_factory, capsys) -> None:
    pm = miles_pm_factory(errors="raise")
    pm.register(plugin_module("b", miles_tasks=raising("boom")), name="bad", distribution="bad-dist")
    pm.register(plugin_module("g", miles_tasks=lambda: [Task("fine")]), name="good")
    code, out, _ = run(["plugins", "list", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["strict"] == {"policy": "raise", "passes": False, "broken": ["bad-dist:bad"]}
    assert {p["name"]: p["status"] for p in doc["plugins"]} == {"bad": "broken", "good": "ok"}
    code, out, _ = run(["plugins", "list"], capsys)
    assert code == 0 and "MILES_PLUGIN_ERRORS=raise: every command that loads plugins fails" in out
    with pytest.raises(Exception, match="boom"):  # outside listing, strict mode still raises
        pm.active_contributions("tasks")


def test_strict_mode_verdict_passes_when_nothing_is_broken(miles_pm_factory, capsys) -> None:
    pm = miles_pm_factory(errors="raise")
    pm.register(plugin_module("g", miles_tasks=lambda: [Task("fine")]), name="good")
    code, out, _ = run(["plugins", "list"], capsys)
    assert code == 0 and "MILES_PLUGIN_ERRORS=raise: no plugin is broken; strict mode passes" in out


# -- what was verified ------------------------------------------------------------------------


def test_cheap_verifies_run_and_a_failure_is_not_listed_ok(miles_pm, capsys) -> None:
    miles_pm.register(
        plugin_module("t", miles_tasks=lambda: [Task("passes"), Task("fails", fail_with="no prompts"),
                                                Task("costly", fail_with="never run", cheap_verify=False)]),
        name="tasks-plugin",
    )
    code, out, _ = run(["plugins", "list", "--json"], capsys)
    assert code == 0
    (record,) = json.loads(out)["plugins"]
    assert record["status"] == "broken"
    assert "verify: tasks 'fails': RuntimeError: no prompts" in record["reason"]
    assert record["verified"] == {"tasks": ["passes"]}
    assert record["not_verified"] == {"tasks": ["costly"]}  # not cheap: left to `miles doctor`
    code, out, _ = run(["plugins", "list"], capsys)
    assert code == 0 and "1/3, 1 failed" in out and "cheap_verify = True" in out
    code, out, _ = run(["plugins", "show", "tasks-plugin"], capsys)
    assert code == 0 and "tasks: passes (verified), fails (failed), costly (not verified)" in out


def test_an_unverified_plugin_is_listed_as_not_verified(miles_pm, capsys) -> None:
    miles_pm.register(plugin_module("t", miles_tasks=lambda: [Task("costly", cheap_verify=False)]), name="p")
    code, out, _ = run(["plugins", "list", "--json"], capsys)
    (record,) = json.loads(out)["plugins"]
    assert (record["status"], record["verified"], record["not_verified"]) == ("ok", {}, {"tasks": ["costly"]})
    code, out, _ = run(["plugins", "list"], capsys)
    assert code == 0 and "0/1" in out


def test_the_builtin_tasks_are_verified_by_listing(miles_pm_factory) -> None:
    pm = miles_pm_factory(builtins=True)
    pm.verify_cheap()
    assert pm.get("core-tasks").verified() == {"tasks": ["arith-add", "arith-next"]}


# -- slow plugins are flagged with their measured time ----------------------------------------


def _probe_plugins(root: Path, monkeypatch: pytest.MonkeyPatch, sources: dict[str, str]) -> list[EntryPointInfo]:
    for module, source in sources.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(root))
    return [EntryPointInfo(m.replace("_", "-"), m, f"{m}-dist", "0.1") for m in sources]


def test_slow_imports_are_flagged_with_the_measured_time(tmp_path, monkeypatch) -> None:
    import miles_core.plugins as plugins

    eps = _probe_plugins(tmp_path, monkeypatch, {
        "sleepy_probe": "import time\ntime.sleep(0.15)\n",
        "heavy_probe": "import fake_heavy_lib\n",
        "quick_probe": "X = 1\n",
        "fake_heavy_lib": "",
    })[:3]
    monkeypatch.setattr(plugins, "entry_points", lambda group: eps)
    monkeypatch.setattr(plugins, "HEAVY_MODULES", ("fake_heavy_lib",))
    pm = MilesPluginManager.from_environment({"MILES_PLUGIN_SLOW_MS": "100"})
    pm.discover()
    sleepy, heavy, quick = (pm.get(f"{n}-probe") for n in ("sleepy", "heavy", "quick"))
    assert sleepy.import_ms >= 150 and sleepy.slow.startswith(f"slow to load: {sleepy.load_ms:.0f} ms")
    assert "threshold 100 ms" in sleepy.slow
    assert heavy.heavy_imports == {"fake_heavy_lib": "import"}
    assert "imports fake_heavy_lib (at import)" in heavy.slow
    assert quick.slow is None and quick.to_dict()["load"]["slow"] is None
    flagged = [r for r in run_doctor(pm, concerns=("plugins",)).results if r.status == "warn"]
    assert sorted(r.item for r in flagged) == ["heavy-probe load time", "sleepy-probe load time"]
    assert all(not r.required for r in flagged)


def test_a_plugin_importing_torch_at_module_level_is_flagged(tmp_path) -> None:
    (tmp_path / "torchy_probe.py").write_text("import torch\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import miles_core.plugins as plugins
        from miles_core.entry_points import EntryPointInfo
        plugins.entry_points = lambda group: [EntryPointInfo("torchy", "torchy_probe", "torchy-dist", "0.1")]
        from miles_core.cli import main
        main(["plugins", "list"])
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")} | {"COLUMNS": "4000"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "slow to load: " in out.stdout and "imports torch (at import)" in out.stdout


# -- a plugin's hardware backend replacing the built-in cpu is said out loud ------------------


def _replacing_backend_plugin():
    from miles_core.hardware.cpu import CpuBackend

    class ProbeCpu(CpuBackend):
        name = "probe-cpu"  # claims this machine exactly when the built-in cpu does

    return plugin_module("hw", miles_hardware_backends=lambda: [ProbeCpu()])


def test_doctor_says_a_plugin_backend_replaces_the_builtin_cpu(miles_pm_factory, monkeypatch) -> None:
    from miles_core.hardware.activation import activate

    monkeypatch.setattr("miles_core.hardware.doctor.LIBRARIES", ())  # preparing megatron is beside the point
    pm = miles_pm_factory(builtins=True)
    if not any(c.obj.detect().claimed for c in pm.contributions("hardware") if c.name == "cpu"):
        pytest.skip("the built-in cpu backend does not claim this machine (a GPU is visible)")
    pm.register(_replacing_backend_plugin(), name="probe-hw", distribution="probe-hw-dist", version="2.0")
    results = {r.item: r for r in run_doctor(pm, concerns=("hardware",)).results}
    note = results["replaces built-in"]
    assert (note.status, note.required, note.data) == ("warn", False, {"replaced": ["cpu"]})
    assert "'probe-cpu' of plugin 'probe-hw' (probe-hw-dist 2.0) replaces the built-in 'cpu'" in note.detail
    assert "MILES_HARDWARE=cpu selects the built-in" in note.detail
    summary = activate(pm).summary()
    assert (summary["backend"], summary["builtin"], summary["replaces"]) == ("probe-cpu", False, ["cpu"])
    assert summary["distribution"] == "probe-hw-dist"


def test_the_builtin_cpu_replaces_nothing(miles_pm_factory, monkeypatch) -> None:
    from miles_core.hardware.activation import activate

    monkeypatch.setattr("miles_core.hardware.doctor.LIBRARIES", ())
    pm = miles_pm_factory(builtins=True)
    summary = activate(pm).summary()
    assert summary["builtin"] is True and summary["replaces"] == []
    assert "replaces built-in" not in {r.item for r in run_doctor(pm, concerns=("hardware",)).results}


def test_visible_escapes_only_what_cannot_be_printed() -> None:
    assert visible("plain [text] é 😀") == "plain [text] é 😀"
    assert visible("a\nb\tc\x1b\x85\u202e\U000e0001") == "a\\nb\\tc\\x1b\\x85\\u202e\\U000e0001"
