"""est_time proposals from JUnit reports and in-place rewriting of the literals."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def ours(path: Path, runs: list[tuple[str, str, float, str]]) -> Path:
    """A report in the `miles ci run --junit` format: (file, hardware, seconds, status)."""
    root = ET.Element("testsuites")
    for file, hardware, seconds, status in runs:
        suite = ET.SubElement(root, "testsuite", name=file, time=str(seconds))
        props = ET.SubElement(suite, "properties")
        for key, value in (
            ("file", file),
            ("hardware", hardware),
            ("elapsed", str(seconds)),
            ("status", status),
        ):
            ET.SubElement(props, "property", name=f"miles.{key}", value=value)
    ET.ElementTree(root).write(path)
    return path


def test_proposes_and_rewrites_only_the_literal(tree, cli, tmp_path) -> None:
    keyword = tree.test_file(
        "tests/test_kw.py", 'register_cpu_ci(est_time=10, suite="unit")  # keep this comment'
    )
    positional = tree.test_file("tests/sub/test_pos.py", 'register_cpu_ci(2.5, "unit", labels=["slow"])')
    steady = tree.test_file("tests/test_steady.py", 'register_cpu_ci(est_time=30, suite="unit")')
    report = ours(
        tmp_path / "a.xml",
        [
            ("tests/test_kw.py", "cpu", 40.2, "passed"),
            ("tests/sub/test_pos.py", "cpu", 7.0, "passed"),
            ("tests/test_steady.py", "cpu", 33.0, "passed"),  # within the 25% tolerance
        ],
    )
    second = ours(
        tmp_path / "b.xml",
        [("tests/test_kw.py", "cpu", 50.0, "passed"), ("tests/test_kw.py", "cpu", 90.0, "failed")],
    )
    before = {p: p.read_text() for p in (keyword, positional, steady)}

    dry = cli(
        "ci", "est-times", "--root", str(tree.root), "--from", str(report), "--from", str(second), "--json"
    )
    assert dry.code == 0
    proposals = {p["path"]: p for p in dry.json()["proposals"]}
    assert (proposals["tests/test_kw.py"]["measured"], proposals["tests/test_kw.py"]["proposed"]) == (
        45.1,
        46.0,
    )
    assert proposals["tests/test_kw.py"]["runs"] == 2  # the failed run is not a measurement
    assert proposals["tests/sub/test_pos.py"]["proposed"] == 7.0
    assert proposals["tests/test_steady.py"]["changed"] is False
    assert any("tests/test_kw.py failed after 90.0 s" in note for note in dry.json()["notes"])
    assert {p: p.read_text() for p in before} == before  # a dry run changes nothing

    wrote = cli(
        "ci", "est-times", "--root", str(tree.root), "--from", str(report), "--from", str(second), "--write"
    )
    assert wrote.code == 0 and "rewrote 2 est_time literal(s) in 2 file(s)" in wrote.out
    assert keyword.read_text() == before[keyword].replace("est_time=10,", "est_time=46,")
    assert positional.read_text() == before[positional].replace("(2.5,", "(7,")
    assert steady.read_text() == before[steady]
    assert {r.path: r.est_time for r in tree.catalog().registrations} == {
        "tests/test_kw.py": 46.0,
        "tests/sub/test_pos.py": 7.0,
        "tests/test_steady.py": 30.0,
    }


def test_plain_pytest_junit_needs_hardware_when_a_file_has_several(tree, cli, tmp_path) -> None:
    tree.test_file(
        "tests/test_both.py",
        'register_cpu_ci(5, "unit")\nregister_cuda_ci(5, "gpu-1", labels=["gpu"])',
    )
    report = tmp_path / "pytest.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_both" name="test_a" time="12.0"/>'
        '<testcase classname="tests.test_both.TestK" name="test_b" time="8.0"/>'
        '<testcase classname="elsewhere.test_z" name="test_c" time="1.0"/>'
        "</testsuite></testsuites>"
    )
    ambiguous = cli("ci", "est-times", "--root", str(tree.root), "--from", str(report), "--json").json()
    assert ambiguous["proposals"] == []
    assert any("2 matching registrations (cpu, cuda); pass --hw" in n for n in ambiguous["notes"])
    assert any("elsewhere.test_z is not a registered test file" in n for n in ambiguous["notes"])
    chosen = cli(
        "ci", "est-times", "--root", str(tree.root), "--from", str(report), "--hw", "cuda", "--json"
    ).json()
    assert [(p["hardware"], p["measured"], p["proposed"]) for p in chosen["proposals"]] == [
        ("cuda", 20.0, 20.0)
    ]


def test_a_literal_changed_since_reading_aborts_without_writing(tree, tmp_path) -> None:
    from miles_core.ci.est_times import propose, rewrite
    from miles_core.ci.junit import read_measurements
    from miles_core.errors import MilesError

    first = tree.test_file("tests/test_a.py", 'register_cpu_ci(est_time=10, suite="unit")')
    second = tree.test_file("tests/test_b.py", 'register_cpu_ci(est_time=10, suite="unit")')
    report = ours(
        tmp_path / "r.xml",
        [("tests/test_a.py", "cpu", 60.0, "passed"), ("tests/test_b.py", "cpu", 60.0, "passed")],
    )
    proposals, _ = propose(tree.catalog(), read_measurements(report))
    second.write_text(second.read_text().replace("est_time=10", "est_time=11"))
    snapshot = first.read_text(), second.read_text()
    try:
        rewrite(tree.root, proposals)
    except MilesError as exc:
        assert "tests/test_b.py:3: est_time literal changed since it was read" in str(exc)
    else:
        raise AssertionError("a stale literal must abort the rewrite")
    assert (first.read_text(), second.read_text()) == snapshot


def test_unreadable_report_is_a_configuration_error(tree, cli, tmp_path) -> None:
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "unit")')
    bad = tmp_path / "bad.xml"
    bad.write_text("<testsuites>")
    result = cli("ci", "est-times", "--root", str(tree.root), "--from", str(bad))
    assert result.code == 2 and "not a readable JUnit XML file" in result.err
