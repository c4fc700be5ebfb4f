"""Run a shard's test files: one pytest process per file, in its own process group.

Each file runs under a supervisor (:mod:`miles_core.ci.proctree`) that kills every process the
file started when pytest exits -- including children that left its process group and session
with ``setsid`` -- so nothing outlives its file. Each file gets ``max(timeout_base, 1.25 *
est_time)`` seconds; when it runs over, the supervisor is told to stop and kills the whole tree.
A file that ends in a failure class its hardware kind declares retriable is run again, up to
``max_attempts`` times.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles_core.ci.base import CIHardware
from miles_core.ci.discovery import Registration
from miles_core.ci.proctree import supervised
from miles_core.ci.selection import Selection
from miles_core.ci.sharding import ShardPlan

PASSING = ("passed", "deselected")
DRIFT_FACTOR = 2.0
_DESELECTING = ("-k", "-m")


@dataclass(frozen=True)
class Attempt:
    returncode: int | None
    elapsed: float
    timed_out: bool
    status: str
    testcases: tuple[ET.Element, ...] = ()


@dataclass
class FileResult:
    registration: Registration
    timeout: float
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.attempts[-1].status if self.attempts else "not run"

    @property
    def elapsed(self) -> float:
        return self.attempts[-1].elapsed if self.attempts else 0.0

    @property
    def total_elapsed(self) -> float:
        return sum(a.elapsed for a in self.attempts)

    @property
    def failed(self) -> bool:
        return self.status not in (*PASSING, "not run")

    @property
    def drift(self) -> float | None:
        """Elapsed over est_time, for runs that measured the file (None otherwise)."""
        if not self.attempts or self.status in ("deselected", "crash"):
            return None
        return self.elapsed / self.registration.est_time

    @property
    def drifted(self) -> bool:
        drift = self.drift
        return drift is not None and (drift > DRIFT_FACTOR or drift < 1 / DRIFT_FACTOR)


@dataclass
class RunReport:
    selection: Selection
    hardware: str
    partition: tuple[int, int]
    plan: ShardPlan
    files: tuple[Registration, ...]
    results: list[FileResult] = field(default_factory=list)

    @property
    def failures(self) -> list[FileResult]:
        return [r for r in self.results if r.failed]

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0


def file_timeout(est_time: float, base: float) -> float:
    return max(base, 1.25 * est_time)


#: how long a stopped supervisor may take to kill its tree before it is killed itself
STOP_GRACE_S = 15.0


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already empty


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Ask the supervisor to kill the tree and exit; kill its process group if it does not."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait()


def run_pytest_file(
    root: Path,
    path: str,
    timeout: float,
    pytest_args: Sequence[str],
    junit_path: Path,
    stdout: int | None = None,
) -> tuple[int | None, float, bool]:
    """Run pytest on one file under the supervisor; return (exit code, seconds, timed out)."""
    command = supervised([sys.executable, "-m", "pytest", path, *pytest_args, f"--junitxml={junit_path}"])
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=root, start_new_session=True, stdout=stdout)
    timed_out = False
    try:
        returncode: int | None = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        returncode = None
    finally:
        _stop(process)  # a no-op once the supervisor has exited (the tree is gone by then)
        _kill_group(process.pid)
    return returncode, time.monotonic() - started, timed_out


def classify(
    returncode: int | None, timed_out: bool, testcases: Sequence[ET.Element], pytest_args: Sequence[str]
) -> str:
    """``passed``, ``deselected`` (``-k``/``-m`` left nothing to run) or a failure class."""
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "passed"
    if returncode == 5:
        deselecting = any(arg in _DESELECTING or arg.startswith(_DESELECTING) for arg in pytest_args)
        return "deselected" if deselecting else "no-tests"
    if returncode == 1:
        return "failed" if any(tc.find("failure") is not None for tc in testcases) else "error"
    if returncode in (2, 3, 4):
        return "error"
    return "crash"


def read_testcases(junit_path: Path) -> tuple[ET.Element, ...]:
    """The testcases of a pytest JUnit file; empty when pytest died before writing it."""
    if not junit_path.is_file():
        return ()
    try:
        return tuple(ET.parse(junit_path).getroot().iter("testcase"))
    except ET.ParseError:
        return ()


def run_files(
    report: RunReport,
    kind: CIHardware,
    *,
    root: Path,
    timeout_base: float,
    max_attempts: int,
    pytest_args: Sequence[str],
    fail_fast: bool = False,
    stdout: int | None = None,
    announce: Callable[[str], None] = print,
) -> RunReport:
    """Run ``report.files`` in order, filling ``report.results``."""
    total = len(report.files)
    with tempfile.TemporaryDirectory(prefix="miles-ci-") as scratch:
        for index, reg in enumerate(report.files, 1):
            result = FileResult(reg, file_timeout(reg.est_time, timeout_base))
            report.results.append(result)
            if fail_fast and any(r.failed for r in report.results[:-1]):
                continue
            for attempt in range(1, max_attempts + 1):
                announce(
                    f"[{index}/{total}] {reg.path} (est {reg.est_time:g} s, timeout {result.timeout:g} s, attempt {attempt})"
                )
                junit_path = Path(scratch) / f"{index}-{attempt}.xml"
                returncode, elapsed, timed_out = run_pytest_file(
                    root, reg.path, result.timeout, pytest_args, junit_path, stdout
                )
                testcases = read_testcases(junit_path)
                status = classify(returncode, timed_out, testcases, pytest_args)
                result.attempts.append(Attempt(returncode, elapsed, timed_out, status, testcases))
                announce(f"[{index}/{total}] {reg.path} {status} in {elapsed:.1f} s")
                if status in PASSING or status not in kind.retriable or attempt == max_attempts:
                    break
                announce(
                    f"[{index}/{total}] {reg.path}: {status} is retriable on {kind.name}; running it again"
                )
    return report
