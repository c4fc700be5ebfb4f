"""The runner: real pytest processes per file, classification, process-group timeouts, retries
limited to the hardware's retriable classes, exit codes, JUnit and drift reporting."""

from __future__ import annotations

import os
import signal
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from miles_core.ci.builtin import CPU, CUDA
from miles_core.ci.register import register_cpu_ci
from miles_core.ci.runner import RunReport, run_files
from miles_core.ci.selection import resolve_labels, select
from miles_core.ci.sharding import plan_shards

register_cpu_ci(est_time=32, suite="stage-a-cpu")

# The files these tests run use neither plugin; hypothesis' pytest plugin alone costs seconds per
# process where bytecode caching is off (PYTHONDONTWRITEBYTECODE), so the child runs skip it.
LEAN = ("-p", "no:hypothesispytest", "-p", "no:cacheprovider")
FAILING = "def test_bad():\n    assert 1 == 2\n"
COLLECTION_ERROR = "import not_a_module_anywhere\n\ndef test_x():\n    pass\n"


def _alive(pid: int) -> bool:
    """True while ``pid`` is a live (not zombie) process."""
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        return False
    return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def run_integration(cli, tree, *args: str):
    """``miles ci run`` on the tree's ``integration`` suite."""
    return cli("ci", "run", "--root", str(tree.root), "--hw", "cpu", "--suite", "integration", *args)


def _report(catalog, suite: str) -> RunReport:
    selection = select(catalog, "cpu", suite, resolve_labels(catalog), "regular")
    plan = plan_shards([(r.path, r.est_time) for r in selection.selected], 1)
    return RunReport(selection, "cpu", (0, 1), plan, tuple(sorted(selection.selected, key=lambda r: r.path)))


def test_statuses_exit_code_junit_and_drift(tree, cli, tmp_path) -> None:
    stray = tmp_path / "stray.pid"
    leaves_a_process = (
        "import subprocess\n\n"
        "def test_ok():\n"
        f"    open({str(stray)!r}, 'w').write(str(subprocess.Popen(['sleep', '300']).pid))\n"
    )
    tree.test_file("tests/test_pass.py", 'register_cpu_ci(100, "integration")', leaves_a_process)
    tree.test_file("tests/test_fail.py", 'register_cpu_ci(1, "integration")', FAILING)
    tree.test_file("tests/test_collect.py", 'register_cpu_ci(1, "integration")', COLLECTION_ERROR)
    tree.test_file("tests/test_empty.py", 'register_cpu_ci(1, "integration")', "X = 1\n")
    tree.test_file(
        "tests/test_off.py", 'register_cpu_ci(1, "integration", disabled="needs a fix", issue="#4")', FAILING
    )
    junit = tmp_path / "out" / "junit.xml"
    result = run_integration(cli, tree, "--junit", str(junit), "--json", "--", *LEAN)
    assert result.code == 1
    data = result.json()
    statuses = {r["path"]: r["status"] for r in data["results"]}
    assert statuses == {
        "tests/test_pass.py": "passed",
        "tests/test_fail.py": "failed",
        "tests/test_collect.py": "error",
        "tests/test_empty.py": "no-tests",
    }
    assert not _alive(int(stray.read_text())), "a process the passing file left behind survived"
    passed = next(r for r in data["results"] if r["path"] == "tests/test_pass.py")
    assert passed["drifted"] and passed["drift"] < 0.5 and passed["timeout"] == 125.0
    assert data["disabled"] == [
        {"path": "tests/test_off.py", "line": 3, "reason": "needs a fix", "issue": "#4"}
    ]
    assert "disabled tests/test_off.py:3: needs a fix (tracking: #4)" in result.err
    assert "DRIFT" in result.err and "est_time is off by more than 2x" in result.err

    suites = {s.get("name"): s for s in ET.parse(junit).getroot().iter("testsuite")}
    assert set(suites) == {*statuses, "tests/test_off.py"}
    props = {p.get("name"): p.get("value") for p in suites["tests/test_fail.py"].iter("property")}
    assert (
        props["miles.status"] == "failed"
        and props["miles.hardware"] == "cpu"
        and props["miles.est_time"] == "1"
    )
    assert suites["tests/test_fail.py"].get("failures") == "1"
    assert suites["tests/test_empty.py"].find("testcase/error").get("type") == "no-tests"
    assert suites["tests/test_off.py"].find("testcase/skipped").get("message") == "disabled: needs a fix (#4)"


def test_timeout_kills_the_file_and_its_children(tree, tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    tree.test_file(
        "tests/test_hang.py",
        'register_cpu_ci(1, "integration")',
        "import subprocess, time\n\n"
        "def test_hang():\n"
        "    child = subprocess.Popen(['sleep', '300'])\n"
        f"    open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(300)\n",
    )
    report = run_files(
        _report(tree.catalog(), "integration"),
        CPU,
        root=tree.root,
        timeout_base=6,
        max_attempts=3,
        pytest_args=LEAN,
        announce=lambda line: None,
    )
    (result,) = report.results
    assert result.status == "timeout" and len(result.attempts) == 1  # cpu does not retry timeouts
    assert 6 <= result.elapsed < 20
    assert report.exit_code == 1
    child = int(pid_file.read_text())
    assert not _alive(child), "the test's child process outlived the timeout"


DETACHING = r"""
import os, subprocess, sys, time

DAEMON = (
    "import os, sys, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    open(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\n"
    "    time.sleep(300)\n"
)


def test_detach():
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)  # setsid
    open(PIDS, "a").write(f"{child.pid}\n")
    # a double fork: the middle process exits, the grandchild leaves the session with setsid
    subprocess.run([sys.executable, "-c", DAEMON, PIDS], check=True)
    deadline = time.monotonic() + 20
    while len(open(PIDS).read().split()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    if HANG:
        time.sleep(300)
"""


@pytest.mark.parametrize("hang", [False, True], ids=["finished", "timed-out"])
def test_processes_that_leave_the_session_are_killed(tree, tmp_path, hang) -> None:
    pids = tmp_path / "pids"
    tree.test_file(
        "tests/test_detach.py", 'register_cpu_ci(1, "integration")', f"PIDS = {str(pids)!r}\nHANG = {hang}\n" + DETACHING
    )
    report = run_files(
        _report(tree.catalog(), "integration"),
        CPU,
        root=tree.root,
        timeout_base=8,
        max_attempts=1,
        pytest_args=LEAN,
        announce=lambda line: None,
    )
    assert report.results[0].status == ("timeout" if hang else "passed")
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    survivors = [pid for pid in started if _alive(pid)]
    for pid in survivors:  # leave nothing behind if the assertion fails
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], "a process that called setsid outlived its test file"


def test_retries_only_failure_classes_the_hardware_declares(tree, tmp_path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    crash_once = (
        "import os, pathlib, signal\n\n"
        "def test_crash_once():\n"
        f"    mark = pathlib.Path({str(marks)!r}) / pathlib.Path(__file__).name\n"
        "    if not mark.exists():\n"
        "        mark.touch()\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    tree.test_file("tests/test_crash.py", 'register_cpu_ci(1, "integration")', crash_once)
    tree.test_file("tests/test_fail.py", 'register_cpu_ci(1, "integration")', FAILING)
    catalog = tree.catalog()
    options = dict(
        root=tree.root, timeout_base=60, max_attempts=2, pytest_args=LEAN, announce=lambda line: None
    )
    on_cuda = run_files(_report(catalog, "integration"), CUDA, **options)  # cuda retries crashes
    assert {r.registration.path: [a.status for a in r.attempts] for r in on_cuda.results} == {
        "tests/test_crash.py": ["crash", "passed"],
        "tests/test_fail.py": ["failed"],  # a test failure is never retried
    }
    assert [r.registration.path for r in on_cuda.failures] == ["tests/test_fail.py"]
    for mark in marks.iterdir():
        mark.unlink()
    on_cpu = run_files(_report(catalog, "integration"), CPU, **options)  # cpu retries nothing
    assert [(r.status, len(r.attempts)) for r in on_cpu.results] == [("crash", 1), ("failed", 1)]


def test_pytest_arguments_pass_through(tree, cli) -> None:
    tree.test_file("tests/test_pass.py", 'register_cpu_ci(2, "integration")')
    ok = run_integration(cli, tree, "--json", "--", *LEAN, "-q")
    assert ok.code == 0 and ok.json()["results"][0]["status"] == "passed"
    none = run_integration(cli, tree, "--json", "--", *LEAN, "-k", "no_such_test")
    assert none.code == 0 and none.json()["results"][0]["status"] == "deselected"
    junitxml = run_integration(cli, tree, "--", "--junitxml=x.xml")
    assert junitxml.code == 2 and "pass --junit PATH to miles ci run" in junitxml.err


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (("--suite", "unti"), 2, "unknown suite 'unti' (did you mean 'unit'?)"),
        (("--suite", "unit", "--partition", "2/2"), 2, "partitions are 0-based"),
        (("--suite", "unit", "--partition", "x"), 2, "--partition must be I/N"),
        (("--suite", "gpu-1"), 2, "suite 'gpu-1' runs on cuda, not cpu"),
        (("--suite", "unit", "--labels", "gpx"), 2, "unknown label 'gpx'"),
        (("--suite", "unit", "--list-only"), 0, "this partition: 1 file(s)"),
        (("--suite", "integration"), 0, "nothing selected: exit 0"),
    ],
)
def test_exit_codes_without_running_tests(tree, cli, args, code: int, fragment: str) -> None:
    tree.test_file("tests/test_fail.py", 'register_cpu_ci(1, "unit")', FAILING)  # --list-only must not run it
    tree.test_file("tests/test_slow.py", 'register_cpu_ci(1, "integration", labels=["slow"])', FAILING)
    result = cli("ci", "run", "--root", str(tree.root), "--hw", "cpu", *args)
    assert result.code == code, result.err
    assert fragment in result.out + result.err


def test_summary_file_is_markdown_with_disabled_entries(tree, cli, tmp_path) -> None:
    tree.test_file("tests/test_pass.py", 'register_cpu_ci(2, "integration")')
    tree.test_file("tests/test_off.py", 'register_cpu_ci(2, "integration", disabled="broken on 3.12")')
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    result = run_integration(cli, tree, "--summary", str(summary), "--", *LEAN)
    assert result.code == 0
    text = summary.read_text()
    assert text.startswith("earlier step\n### integration (cpu), partition 0/1")
    assert "| `tests/test_pass.py` | passed | 1 |" in text
    assert "- disabled tests/test_off.py:3: broken on 3.12" in text
    assert run_integration(cli, tree, "--list-only", "--json").json()["files"]
