"""Registration discovery: every validation rule, with its file:line, and what is accepted."""

from __future__ import annotations

import pytest

from miles_core.ci.builtin import CPU, CUDA
from miles_core.ci.discovery import Marker, parse_source
from miles_core.ci.register import register_cpu_ci
from miles_core.errors import ConfigError

register_cpu_ci(est_time=1, suite="stage-a-cpu")

MARKERS = {
    kind.marker_name: Marker(kind.marker_name, kind.name, kind.marker_parameters()) for kind in (CPU, CUDA)
}
IMPORTS = "from miles_core.ci.register import register_cpu_ci, register_cuda_ci\n"


def parse(body: str) -> tuple[list, list[str]]:
    return parse_source(IMPORTS + body, "tests/test_x.py", MARKERS)


def test_accepts_keywords_positionals_attribute_calls_and_several_hardware() -> None:
    body = (
        "import miles_core.ci.register as reg\n"
        'register_cpu_ci(12, "unit", labels=["slow"], nightly=True)\n'
        'reg.register_cuda_ci(est_time=7.5, suite="gpu-4", labels=["gpu"], num_gpus=4, layout={"tp": 2})\n'
        'register_cuda_ci(3, "gpu-1", labels=["gpu"], disabled="flaky NCCL init", issue="example/project#12")\n'
    )
    regs, problems = parse(body)
    assert problems == []
    cpu, gpu4, gpu1 = regs
    assert (cpu.hardware, cpu.est_time, cpu.suite, cpu.labels, cpu.nightly, cpu.line) == (
        "cpu",
        12.0,
        "unit",
        ("slow",),
        True,
        3,
    )
    assert (gpu4.hardware, gpu4.num_gpus, dict(gpu4.layout), gpu4.location) == (
        "cuda",
        4,
        {"tp": 2},
        "tests/test_x.py:4",
    )
    assert (gpu1.disabled, gpu1.issue, gpu1.enabled) == ("flaky NCCL init", "example/project#12", False)
    line, col, end_line, end_col = gpu4.est_span
    assert line == end_line and (IMPORTS + body).splitlines()[line - 1][col:end_col] == "7.5"


@pytest.mark.parametrize(
    ("body", "line", "fragment"),
    [
        (
            'register_cpu_ci(est_time=x, suite="unit")\n',
            2,
            "est_time must be a literal (test files are never imported), got x",
        ),
        (
            'register_cpu_ci(est_time=0, suite="unit")\n',
            2,
            "est_time must be a positive number of seconds, got 0",
        ),
        (
            'register_cpu_ci(est_time=True, suite="unit")\n',
            2,
            "est_time must be a positive number of seconds, got True",
        ),
        ('register_cpu_ci(est_time="5", suite="unit")\n', 2, "est_time must be a positive number"),
        ("register_cpu_ci(est_time=5)\n", 2, "missing required argument 'suite'"),
        ('register_cpu_ci(5, "unit", ["slow"])\n', 2, "only est_time and suite may be positional"),
        ('register_cpu_ci(5, "unit", suite="unit")\n', 2, "suite is given twice"),
        ('register_cpu_ci(5, "unit", *args)\n', 2, "*args is not allowed"),
        ('register_cpu_ci(5, "unit", **extra)\n', 2, "**kwargs is not allowed"),
        ('register_cpu_ci(5, "unit", num_gpus=1)\n', 2, "register_cpu_ci has no parameter 'num_gpus'"),
        (
            'register_cpu_ci(5, "unit", lables=["slow"])\n',
            2,
            "has no parameter 'lables' (did you mean 'labels'?)",
        ),
        ('register_cpu_ci(5, "unit", labels="slow")\n', 2, "labels must be a list of distinct label names"),
        (
            'register_cpu_ci(5, "unit", labels=["a", "a"])\n',
            2,
            "labels must be a list of distinct label names",
        ),
        ('register_cpu_ci(5, "unit", nightly=1)\n', 2, "nightly must be True or False, got 1"),
        ('register_cpu_ci(5, "unit", disabled="")\n', 2, "disabled must be a non-empty reason string"),
        (
            'register_cpu_ci(5, "unit", disabled="broken", issue="soon")\n',
            2,
            "issue must be a URL or an issue reference",
        ),
        (
            'register_cpu_ci(5, "unit", issue="https://x.org/1")\n',
            2,
            "issue= tracks why an entry is disabled; it needs disabled=",
        ),
        (
            'register_cuda_ci(5, "gpu-1", labels=["gpu"], num_gpus=0)\n',
            2,
            "num_gpus must be a positive integer, got 0",
        ),
        (
            'register_cuda_ci(5, "gpu-1", labels=["gpu"], layout=[2])\n',
            2,
            "layout must be a dict of axis name to integer",
        ),
        ('if True:\n    register_cpu_ci(5, "unit")\n', 3, "must be a module-level statement"),
        ('def helper():\n    register_cpu_ci(5, "unit")\n', 3, "must be a module-level statement"),
        ('x = register_cpu_ci(5, "unit")\n', 2, "must be a module-level statement"),
        ("mark = register_cpu_ci\n", 2, "is referenced without being called"),
        (
            'register_cpu_ci(5, "unit")\nregister_cpu_ci(6, "unit")\n',
            3,
            "duplicate registration for cpu suite 'unit' (first at line 2)",
        ),
        ("def broken(:\n", 2, "cannot compile"),
    ],
)
def test_rejects(body: str, line: int, fragment: str) -> None:
    regs, problems = parse(body)
    assert regs == [] or "duplicate" in fragment
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"tests/test_x.py:{line}: ")
    assert fragment in problems[0]


def test_import_alias_and_missing_registration_are_errors() -> None:
    _, problems = parse_source(
        "from miles_core.ci.register import register_cpu_ci as reg\nreg(5, 'unit')\n",
        "tests/test_a.py",
        MARKERS,
    )
    assert problems == [
        "tests/test_a.py:1: register_cpu_ci is imported as 'reg'; miles ci finds markers by name, import it unaliased"
    ]
    _, problems = parse_source("def test_x():\n    pass\n", "tests/test_b.py", MARKERS)
    assert problems[0].startswith("tests/test_b.py:1: no CI registration: add a module-level call to one of")
    # marker names inside strings are data, not registrations
    _, problems = parse_source("SNIPPET = \"register_cpu_ci(5, 'unit')\"\n", "tests/test_c.py", MARKERS)
    assert problems[0].startswith("tests/test_c.py:1: no CI registration")


def test_unknown_marker_of_an_uninstalled_plugin_is_no_registration() -> None:
    _, problems = parse_source(
        "from miles_rocm.ci import register_rocm_ci\nregister_rocm_ci(5, 'x', labels=['rocm'])\n",
        "tests/test_r.py",
        MARKERS,
    )
    assert problems and "no CI registration" in problems[0]


# -- rules that need the suites (checked when the catalog loads) ---------------------------------


@pytest.mark.parametrize(
    ("registration", "fragment"),
    [
        ('register_cpu_ci(5, "unti")', "unknown suite 'unti' (did you mean 'unit'?)"),
        ('register_cpu_ci(5, "gpu-1")', "suite 'gpu-1' runs on cuda, but register_cpu_ci registers for cpu"),
        ('register_cpu_ci(5, "unit", labels=["slwo"])', "unknown label 'slwo' (did you mean 'slow'?)"),
        (
            'register_cuda_ci(5, "gpu-1")',
            "register_cuda_ci needs labels=[...] so it never takes cuda runners unasked",
        ),
        (
            'register_cuda_ci(5, "gpu-1", labels=["slow"])',
            "label 'slow' is not one of suite gpu-1's labels ['gpu']",
        ),
        (
            'register_cuda_ci(5, "gpu-1", labels=["gpu"], num_gpus=4)',
            "num_gpus=4 does not match suite gpu-1 (1 GPUs per runner) (did you mean 'gpu-4'?)",
        ),
        (
            'register_cuda_ci(5, "gpu-4", labels=["gpu"], num_gpus=3)',
            "num_gpus=3 does not match suite gpu-4 (4 GPUs per runner); no cuda suite has 3 GPUs per runner",
        ),
        (
            'register_cuda_ci(5, "gpu-4", labels=["gpu"], layout={"pp": 2, "ep": 4})',
            "layout (pp=2, ep=4) on 4 GPUs: world size 4 is not divisible by etp*ep*pp = 1*4*2 = 8 "
            "(Megatron's expert-parallel grid)",
        ),
        (
            'register_cuda_ci(5, "gpu-4", labels=["gpu"], layout={"tp": 2, "sp": 2})',
            "unknown layout key(s) ['sp']",
        ),
    ],
)
def test_catalog_rejects_registrations_that_do_not_fit_their_suite(
    tree, registration: str, fragment: str
) -> None:
    tree.test_file("tests/test_reg.py", registration)
    with pytest.raises(ConfigError) as info:
        tree.catalog()
    assert f"tests/test_reg.py:3: {fragment}" in str(info.value)


def test_catalog_reports_every_problem_at_once(tree) -> None:
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "nope")')
    tree.test_file("tests/sub/test_b.py", 'register_cpu_ci(5, "unit", labels=["nope"])')
    tree.write("tests/test_c.py", "def test_x():\n    pass\n")
    tree.write("tests/helpers.py", "X = 1\n")  # not a test file: no registration needed
    with pytest.raises(ConfigError) as info:
        tree.catalog()
    message = str(info.value)
    assert message.startswith("3 problems:")
    for where in ("tests/test_a.py:3", "tests/sub/test_b.py:3", "tests/test_c.py:1"):
        assert where in message
    assert "helpers.py" not in message


def test_discovery_never_imports_test_files(tree, tmp_path) -> None:
    sentinel = tmp_path / "imported"
    tree.test_file(
        "tests/test_side_effect.py",
        'register_cpu_ci(5, "unit")',
        f"open({str(sentinel)!r}, 'w').close()\n\ndef test_x():\n    pass\n",
    )
    catalog = tree.catalog()
    assert [r.path for r in catalog.registrations] == ["tests/test_side_effect.py"]
    assert not sentinel.exists()


TRICKY_SOURCES = [
    'register_cpu_ci(5, "unit")\n\ndef test_a():\n    pass\n',
    'register_cpu_ci(\n    est_time=5,\n    suite="unit",\n    labels=["slow"],\n)\n\ndef test_a():\n    pass\n',
    '"""Docs.\n\nregister_cpu_ci(5, "unit")\n"""\n\ndef test_a():\n    pass\n',
    'X = """\nregister_cpu_ci(5, "unit")\n"""\nregister_cpu_ci(6, "unit")\n',
    'register_cpu_ci(5, "unit")\n\ndef test_a():\n    register_cpu_ci(6, "unit")\n',
    'def test_a():\n    pass\n\nregister_cpu_ci(5, "unit")\n',
    'register_cpu_ci(5, "unit")\nSNIPPET = "register_cpu_ci(1, \'x\')"\n',
    'register_cpu_ci(5, "unit"\n',
    'register_cpu_ci(5, "unit")  # register_cpu_ci\n',
]


@pytest.mark.parametrize("body", TRICKY_SOURCES)
def test_prefix_parsing_agrees_with_parsing_the_whole_file(body: str, monkeypatch) -> None:
    import miles_core.ci.discovery as discovery

    fast = parse(body)
    monkeypatch.setattr(discovery, "_registration_prefix", lambda text, markers: None)
    assert fast == parse(body)


def test_typical_files_take_the_prefix_path() -> None:
    from miles_core.ci.discovery import _registration_prefix

    source = IMPORTS + TRICKY_SOURCES[1]
    prefix = _registration_prefix(source, MARKERS)
    assert prefix is not None and len(prefix.body) == 2  # the import and the call, not the test function
    assert (
        _registration_prefix(IMPORTS + TRICKY_SOURCES[4], MARKERS) is None
    )  # a later mention needs the whole file
