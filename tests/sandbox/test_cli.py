"""`miles sandbox providers|run|sweep`: JSON output, exit codes, bad input, orphan sweeping."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.cli import main
from miles_core.sandbox.base import SandboxSpec
from miles_core.sandbox.lifecycle import SandboxManager
from miles_core.sandbox.local.provider import LocalProvider
from miles_core.sandbox.ownership import Owner

register_cpu_ci(est_time=7, suite="stage-a-cpu")


@pytest.fixture
def cli(sandbox_root: Path, miles_pm_factory, monkeypatch, capsys):  # type: ignore[no-untyped-def]
    """Run `miles ...` with the built-in plugins and a private sandbox root."""
    monkeypatch.setenv("MILES_SANDBOX_ROOT", str(sandbox_root))
    miles_pm_factory(builtins=True)

    def run(*argv: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as info:
            main(list(argv))
        out, err = capsys.readouterr()
        return int(info.value.code or 0), out, err

    return run


def test_providers_json_reports_the_verified_local_provider(cli) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = cli("sandbox", "providers", "--json")
    data = json.loads(out)
    local = {p["name"]: p for p in data["providers"]}["local"]
    assert code == 0 and local["status"] == "ok" and local["plugin"] == "core-sandbox"
    facts = local["facts"]
    assert facts["limits_seen_inside"]["open_files"] == 123
    assert {"root", "isolation", "namespace_tool"} <= set(local["options"])
    assert facts["isolation"] in ("namespaces", "process") and "limits_by" in facts
    if facts["isolation"] == "namespaces":  # says which tool, and checked it from inside
        assert facts["tool"] in ("bwrap", "unshare") and facts["tool_detail"]
        assert facts["seen_inside"]["NoNewPrivs"] == "1"
    code, out, _ = cli("sandbox", "providers")
    assert code == 0 and f"isolation: {facts['isolation']}" in out and "python:" in out
    # the table says how limits are enforced, on lines of their own (not an escaped "\n")
    assert "limits: " in out and "\\n" not in out


def test_run_has_python_on_the_path(cli) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli("sandbox", "run", "--", "python", "-c", "print(1)")
    assert (code, out) == (0, "1\n"), err


def test_probe_reports_every_hostile_probe(cli) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = cli("sandbox", "probe", "--json", "--probe", "environ", "--probe", "host_files")
    report = json.loads(out)
    assert code == 0 and [p["name"] for p in report["probes"]] == ["environ", "host_files"]
    assert report["claimed_escaped"] == 0
    code, _, err = cli("sandbox", "probe", "--probe", "nosuch")
    assert code == 2 and "unknown probe(s) nosuch" in err


def test_run_prints_the_command_result_and_exits_with_its_code(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = cli("sandbox", "run", "--json", "--", "python3", "-c", "print(6 * 7)")
    result = json.loads(out)
    assert code == 0 and result["stdout"] == "42\n" and result["exit_code"] == 0
    source = tmp_path / "solution.py"
    source.write_text("import sys; print(open('hint.txt').read().strip()); sys.exit(3)\n")
    code, out, _ = cli(
        "sandbox",
        "run",
        "--step",
        "echo baked > hint.txt",
        "--file",
        f"{source}:solution.py",
        "--",
        "python3",
        "solution.py",
    )
    assert (code, out) == (3, "baked\n")
    code, _, err = cli("sandbox", "run", "--timeout", "0.3", "--", "sleep", "10")
    assert code == 124, err
    code, out, _ = cli("sandbox", "run", "-e", "WHO=env", "echo $WHO; kill -9 $$")
    assert (code, out) == (137, "env\n")


def test_run_timeout_counts_from_the_commands_start(cli) -> None:  # type: ignore[no-untyped-def]
    """`--timeout` bounds the command, not the set-up: an image build slower than the deadline
    neither times the command out nor keeps it from timing out (exit 124)."""
    slow_setup = ["sandbox", "run", "--step", "sleep 1", "--timeout", "0.5", "--json", "--"]
    code, out, err = cli(*slow_setup, "echo", "ran")
    result = json.loads(out)
    assert (code, result["stdout"], result["timed_out"]) == (0, "ran\n", False), err
    code, out, err = cli(*slow_setup, "sleep", "10")
    result = json.loads(out)
    assert (code, result["timed_out"]) == (124, True), err
    assert result["duration_s"] < 5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-o", "nosuch=1"], "unknown option(s) nosuch"),
        (["-o", "isolate_network=maybe"], "isolate_network: expected true or false"),
        (["-o", "isolation=vm"], "isolation: expected one of namespaces, process"),
        (["-o", "namespace_tool=docker"], "namespace_tool: expected one of auto, bwrap, unshare"),
        (["--env", "NOEQUALS"], "--env 'NOEQUALS': expected KEY=VALUE"),
        (["--file", "/nonexistent/x:y"], "cannot read /nonexistent/x"),
        (["--provider", "nope"], "no sandbox named 'nope'"),
    ],
)
def test_run_rejects_bad_input_with_exit_2(cli, sandbox_root: Path, argv: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("sandbox", "run", *argv, "--", "true")
    assert code == 2 and message in err, err
    assert not (sandbox_root / "sandboxes").exists() or not any((sandbox_root / "sandboxes").iterdir())


def test_run_rejects_a_bad_config_file_naming_it(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "local.toml"
    bad.write_text("root = [unclosed\n")
    code, _, err = cli("sandbox", "run", "--config", str(bad), "--", "true")
    assert code == 2 and str(bad) in err and "invalid TOML" in err


def test_sweep_destroys_orphans_and_keeps_live_owners(cli, sandbox_root: Path) -> None:  # type: ignore[no-untyped-def]
    dead = Owner("run-dead", socket.gethostname(), 2**22 + 1, "")  # no such pid

    async def plant() -> tuple[str, str, int]:
        provider = LocalProvider(sandbox_root)
        orphan = await SandboxManager(provider, owner=dead, keepalive=False).create(SandboxSpec(ttl_s=600))
        live = await SandboxManager(provider, owner=Owner.current("run-live"), keepalive=False).create(
            SandboxSpec(ttl_s=600)
        )
        keeper = (await provider._client()).pid
        provider._metas.clear()  # forget them: the supervisor keeps their TTL, as for a dead owner
        await provider.aclose()
        return orphan.id, live.id, keeper

    orphan, live, keeper = asyncio.run(plant())
    assert _running(keeper)
    code, out, _ = cli("sandbox", "sweep", "--dry-run", "--json")
    report = json.loads(out)
    assert code == 0 and [r["id"] for r in report["destroyed"]] == [orphan] and report["dry_run"]
    code, out, _ = cli("sandbox", "sweep", "--json")
    report = json.loads(out)
    assert [r["id"] for r in report["destroyed"]] == [orphan]
    assert [r["id"] for r in report["kept"]] == [live]
    code, out, _ = cli("sandbox", "sweep", "--owner", "run-live")
    assert code == 0 and f"destroyed {live}" in out
    assert not any((sandbox_root / "sandboxes").iterdir())
    deadline = time.monotonic() + 10  # the TTL keeper notices and exits instead of lingering
    while _running(keeper):
        assert time.monotonic() < deadline, "the supervisor kept running after its sandboxes were swept"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """Alive and not a zombie (the keeper outlives the provider that started it, unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


def test_help_documents_every_option(cli) -> None:  # type: ignore[no-untyped-def]
    for command in ("providers", "run", "sweep", "probe"):
        code, out, _ = cli("sandbox", command, "--help")
        assert code == 0 and "--json" in out
    code, out, _ = cli("--help")
    assert "sandbox" in out
