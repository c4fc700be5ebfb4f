"""JUnit XML: the merged report ``miles ci run --junit`` writes, and reading measured durations.

The merged report has one ``<testsuite>`` per test file, named by its path, whose ``time`` is the
file's wall time (collection and imports included) and whose properties record ``miles.file``,
``miles.hardware``, ``miles.suite``, ``miles.est_time``, ``miles.status``, ``miles.attempts`` and
``miles.elapsed`` (the last attempt). A timeout or crash gets a synthetic ``<error>`` testcase so
that JUnit viewers show it; disabled entries appear as skipped testcases with their reason.

:func:`read_measurements` reads that format, and plain pytest ``--junitxml`` files too (their
per-file time is the sum of the test times, mapped to files through the testcase class names).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from miles_core.ci.runner import RunReport
from miles_core.ci.selection import disabled_reason
from miles_core.errors import ConfigError
from miles_core.fileio import write_bytes_atomic

PROPERTY_PREFIX = "miles."


def _suite_element(parent: ET.Element, name: str, properties: dict[str, str], time: float) -> ET.Element:
    element = ET.SubElement(parent, "testsuite", name=name, time=f"{time:.3f}")
    props = ET.SubElement(element, "properties")
    for key, value in properties.items():
        ET.SubElement(props, "property", name=PROPERTY_PREFIX + key, value=value)
    return element


def _count(element: ET.Element) -> None:
    cases = element.findall("testcase")
    element.set("tests", str(len(cases)))
    for tag, attribute in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
        element.set(attribute, str(sum(1 for c in cases if c.find(tag) is not None)))


def write_junit(report: RunReport, path: Path) -> None:
    """Write the merged report of a run to ``path`` (atomically)."""
    root = ET.Element("testsuites", name=f"miles ci {report.selection.suite.name}")
    for result in report.results:
        reg = result.registration
        element = _suite_element(
            root,
            reg.path,
            {
                "file": reg.path,
                "hardware": reg.hardware,
                "suite": reg.suite,
                "est_time": f"{reg.est_time:g}",
                "status": result.status,
                "attempts": str(len(result.attempts)),
                "elapsed": f"{result.elapsed:.3f}",
            },
            result.total_elapsed,
        )
        last = result.attempts[-1] if result.attempts else None
        if last is not None:
            element.extend(last.testcases)
        if (
            last is not None
            and last.status in ("timeout", "crash", "no-tests", "error")
            and not any(c.find("error") is not None or c.find("failure") is not None for c in last.testcases)
        ):
            case = ET.SubElement(
                element, "testcase", classname="miles.ci", name=reg.path, time=f"{last.elapsed:.3f}"
            )
            detail = {
                "timeout": f"killed after {result.timeout:g} s (est_time {reg.est_time:g} s)",
                "crash": f"pytest ended with exit code {last.returncode}",
                "no-tests": "the file collected no tests",
                "error": f"pytest ended with exit code {last.returncode} before reporting",
            }[last.status]
            ET.SubElement(case, "error", type=last.status, message=detail)
        _count(element)
    suite = report.selection.suite
    for reg in report.selection.disabled:
        reason, issue = disabled_reason(reg, suite)
        element = _suite_element(
            root,
            reg.path,
            {"file": reg.path, "hardware": reg.hardware, "suite": reg.suite, "status": "disabled"},
            0.0,
        )
        case = ET.SubElement(element, "testcase", classname="miles.ci", name=reg.path, time="0")
        ET.SubElement(case, "skipped", message=f"disabled: {reason}" + (f" ({issue})" if issue else ""))
        _count(element)
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, ET.tostring(root, encoding="utf-8", xml_declaration=True))


@dataclass(frozen=True)
class Measurement:
    """One measured run of a test file (``file`` is a root-relative path, or for plain pytest
    reports a dotted module name to resolve against the known files)."""

    file: str
    seconds: float
    status: str
    hardware: str | None
    suite: str | None
    source: str
    dotted: bool = False


def read_measurements(path: Path) -> list[Measurement]:
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:
        raise ConfigError(f"{path}: not a readable JUnit XML file: {exc}") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    measurements: list[Measurement] = []
    plain: dict[str, list[float]] = defaultdict(list)
    plain_failed: set[str] = set()
    for suite in suites:
        props = {
            p.get("name", "")[len(PROPERTY_PREFIX) :]: p.get("value", "")
            for p in suite.iter("property")
            if p.get("name", "").startswith(PROPERTY_PREFIX)
        }
        if "file" in props:
            if props.get("status") == "disabled":
                continue
            measurements.append(
                Measurement(
                    file=props["file"],
                    seconds=float(props.get("elapsed", suite.get("time", "0"))),
                    status=props.get("status", "passed"),
                    hardware=props.get("hardware"),
                    suite=props.get("suite"),
                    source=str(path),
                )
            )
            continue
        for case in suite.iter("testcase"):
            module = case.get("classname", "")
            if not module:
                continue
            plain[module].append(float(case.get("time", "0") or 0))
            if case.find("failure") is not None or case.find("error") is not None:
                plain_failed.add(module)
    for module, times in sorted(plain.items()):
        measurements.append(
            Measurement(
                file=module,
                seconds=sum(times),
                status="failed" if module in plain_failed else "passed",
                hardware=None,
                suite=None,
                source=str(path),
                dotted=True,
            )
        )
    return measurements
