"""CI hardware kinds: verify() proves the marker and default suites, a broken kind fails
activation naming its plugin, discovery stays cheap, and the doctor reports each kind."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import types

import pytest

from miles_core.ci.base import GPUHardware, Suite
from miles_core.ci.builtin import CPU, CUDA
from miles_core.ci.register import register_cpu_ci
from miles_core.hookspecs import hookimpl

register_cpu_ci(est_time=2, suite="stage-a-cpu")


# markers with the signatures under test (a kind names them as "<this module>:<function>")
def good(est_time, suite, *, labels=None, nightly=False, disabled=None, issue=None, num_gpus=None):
    pass


def extra_positional(est_time, suite, labels=None):
    pass


def unknown_param(est_time, suite, *, owner=None):
    pass


def no_default(est_time, suite, *, labels):
    pass


def returns(est_time, suite):
    return "registered"


def wrong_start(suite, est_time):
    pass


def kind(marker: str, **changes) -> GPUHardware:
    fields = {"name": "tpu", "marker": f"{__name__}:{marker}", "labels": {}, "default_suites": ()} | changes
    return dataclasses.replace(CUDA, **fields)


def test_builtin_kinds_verify() -> None:
    CPU.verify()
    CUDA.verify()
    assert CUDA.marker_parameters() == (
        "est_time",
        "suite",
        "labels",
        "nightly",
        "disabled",
        "issue",
        "num_gpus",
        "layout",
    )


@pytest.mark.parametrize(
    ("marker", "fragment"),
    [
        ("missing", f"marker '{__name__}:missing' cannot be imported: AttributeError"),
        ("extra_positional", "parameter 'labels' must be keyword-only"),
        ("unknown_param", "has parameter 'owner' that miles ci cannot parse"),
        ("no_default", "parameter 'labels' needs a default"),
        ("returns", "must be a runtime no-op returning None, got 'registered'"),
        ("wrong_start", "must start with (est_time, suite)"),
    ],
)
def test_verify_rejects_markers_the_parser_and_runtime_would_disagree_on(marker: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        kind(marker).verify()


def test_verify_rejects_bad_retry_classes_and_default_suites() -> None:
    kind("good").verify()
    with pytest.raises(ValueError, match=r"unknown retriable failure class\(es\) \['flaky'\]"):
        kind("good", retriable=frozenset({"flaky"})).verify()
    bad_suite = Suite(name="s", hardware="tpu", runs_on=("self-hosted",), gpus=0, labels=("x",))
    with pytest.raises(ValueError, match="default suite 's': gpus = 0, but tpu suites need at least 1 GPU"):
        kind("good", default_suites=(bad_suite,)).verify()
    badly_named = Suite(name="Stage A", hardware="tpu", runs_on=("self-hosted",), gpus=1, labels=("x",))
    with pytest.raises(ValueError, match="default suite name 'Stage A' is not lowercase"):
        kind("good", default_suites=(badly_named,)).verify()
    cpu_marker_on_gpu = dataclasses.replace(CPU, name="cpu2", marker=f"{__name__}:good")
    with pytest.raises(ValueError, match="of non-GPU hardware accepts \\['num_gpus'\\]"):
        cpu_marker_on_gpu.verify()


def test_a_broken_kind_fails_activation_naming_its_plugin(tree, cli, miles_pm_factory) -> None:
    plugin = types.ModuleType("tpu_plugin")
    plugin.miles_ci_hardware = hookimpl(lambda: [kind("returns")])
    miles_pm_factory(builtins=True, plugins=[("miles-tpu", plugin)])
    tree.test_file("tests/test_a.py", 'register_cpu_ci(5, "unit")')
    result = cli("ci", "list", "--root", str(tree.root))
    assert result.code == 1
    assert "plugin 'miles-tpu'" in result.err and "ci 'tpu' failed verification" in result.err
    not_a_kind = types.ModuleType("odd_plugin")
    not_a_kind.miles_ci_hardware = hookimpl(lambda: [types.SimpleNamespace(name="odd", verify=lambda: None)])
    miles_pm_factory(builtins=True, plugins=[("miles-odd", not_a_kind)])
    result = cli("ci", "list", "--root", str(tree.root))
    assert result.code == 1 and "is not a miles_core.ci.base.CIHardware" in result.err


def test_a_third_party_kind_brings_its_marker(tree, miles_pm_factory) -> None:
    plugin = types.ModuleType("tpu_plugin")
    tpu = kind("good", labels={"tpu": "needs a TPU"})
    plugin.miles_ci_hardware = hookimpl(lambda: [tpu])
    pm = miles_pm_factory(builtins=True, plugins=[("miles-tpu", plugin)])
    tree.write(
        "pyproject.toml",
        (tree.root / "pyproject.toml").read_text()
        + '\n[tool.miles.ci.suites.tpu-4]\nhardware = "tpu"\nruns-on = ["self-hosted", "v5e"]\ngpus = 4\nlabels = ["tpu"]\n',
    )
    tree.write(
        "tests/test_tpu.py",
        "from tpu_plugin.ci import good\n\ngood(30, 'tpu-4', labels=['tpu'], num_gpus=4)\n\ndef test_x():\n    pass\n",
    )
    tree.pm = pm
    catalog = tree.catalog()
    assert [(r.hardware, r.suite, r.num_gpus) for r in catalog.registrations] == [("tpu", "tpu-4", 4)]
    assert catalog.providers["tpu"] == "miles-tpu"


def test_discovery_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "import miles_core.ci.builtin, miles_core.ci.cli, miles_core.ci.base, miles_core.ci.register\n"
        "b = miles_core.ci.builtin.miles_ci_hardware()\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'ray', 'megatron', 'e2b', 'fastapi', 'uvicorn', 'httpx', 'yaml') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_doctor_reports_each_kind_and_fails_on_a_broken_one(ci_pm, miles_pm_factory) -> None:
    from miles_core.doctor import run_doctor

    report = run_doctor(ci_pm, ("ci",))
    assert [(r.item, r.status, r.plugin) for r in report.results] == [
        ("cpu", "ok", "core-ci"),
        ("cuda", "ok", "core-ci"),
    ]
    plugin = types.ModuleType("tpu_plugin")
    plugin.miles_ci_hardware = hookimpl(lambda: [kind("returns")])
    broken = run_doctor(miles_pm_factory(builtins=True, plugins=[("miles-tpu", plugin)]), ("ci",))
    assert not broken.ok
    assert (
        "plugin 'miles-tpu'" in broken.results[-1].detail
        and "must be a runtime no-op" in broken.results[-1].detail
    )
