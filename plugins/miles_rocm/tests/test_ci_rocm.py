"""miles-rocm's CI hardware kind: contributed through the entry point, parses register_rocm_ci
calls (GPU count and parallel layout checked against the suite) and generates the ROCm
workflow: two shards on one 8-GPU host split into two 4-GPU runners, self-hosted gating."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from miles_core.ci.catalog import load_catalog
from miles_core.ci.register import register_cpu_ci
from miles_core.ci.workflows import generate
from miles_core.errors import ConfigError
from miles_core.plugins import MilesPluginManager

register_cpu_ci(est_time=2, suite="stage-a-cpu")

HEADER = "from miles_rocm.ci import register_rocm_ci\n\n"


@pytest.fixture
def pm(miles_pm_factory) -> MilesPluginManager:
    import miles_rocm.plugin

    return miles_pm_factory(builtins=True, plugins=[("miles-rocm", miles_rocm.plugin)])


def project(tmp_path: Path, registration: str) -> Path:
    root = tmp_path / "project"
    (root / "tests").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "demo"\n')  # no suites: the kinds' defaults apply
    (root / "tests" / "test_amd.py").write_text(HEADER + registration + "\n\n\ndef test_x():\n    pass\n")
    return root


def test_rocm_kind_is_contributed_through_the_entry_point() -> None:
    pm = MilesPluginManager()
    pm.discover()
    (rocm,) = [c for c in pm.active_contributions("ci") if c.name == "rocm"]
    assert rocm.plugin.distribution == "miles-rocm"
    pm.verify(rocm, rocm.obj.verify)
    assert rocm.obj.marker_name == "register_rocm_ci" and rocm.obj.retriable == {"crash", "timeout"}


def test_registrations_parse_with_gpu_count_and_layout(tmp_path, pm) -> None:
    ok = project(
        tmp_path,
        'register_rocm_ci(600, "stage-c-4-gpu-mi350", labels=["rocm"], num_gpus=4, layout={"tp": 2, "pp": 2})',
    )
    (reg,) = load_catalog(ok, pm=pm).registrations
    assert (reg.hardware, reg.suite, reg.num_gpus, dict(reg.layout)) == (
        "rocm",
        "stage-c-4-gpu-mi350",
        4,
        {"tp": 2, "pp": 2},
    )


@pytest.mark.parametrize(
    ("registration", "fragment"),
    [
        (
            'register_rocm_ci(600, "stage-c-4-gpu-mi350", labels=["rocm"], num_gpus=8)',
            "num_gpus=8 does not match suite stage-c-4-gpu-mi350 (4 GPUs per runner)",
        ),
        (
            'register_rocm_ci(600, "stage-c-4-gpu-mi350", labels=["rocm"], layout={"pp": 2, "ep": 4})',
            "layout (pp=2, ep=4) on 4 GPUs: world size 4 is not divisible by etp*ep*pp",
        ),
        ('register_rocm_ci(600, "stage-c-4-gpu-mi350")', "register_rocm_ci needs labels=[...]"),
        (
            'register_rocm_ci(600, "stage-c-4-gpu-mi300")',
            "unknown suite 'stage-c-4-gpu-mi300' (did you mean 'stage-c-4-gpu-mi350'?)",
        ),
    ],
)
def test_registrations_that_do_not_fit_the_suite_fail_at_discovery(
    tmp_path, pm, registration, fragment
) -> None:
    with pytest.raises(ConfigError) as info:
        load_catalog(project(tmp_path, registration), pm=pm)
    assert f"tests/test_amd.py:3: {fragment}" in str(info.value)


def test_rocm_workflow_two_shards_split_host_and_gating(tmp_path, pm) -> None:
    root = project(tmp_path, 'register_rocm_ci(600, "stage-c-4-gpu-mi350", labels=["rocm"], num_gpus=4)')
    (root / "tests" / "test_amd_2.py").write_text(
        HEADER + 'register_rocm_ci(300, "stage-c-4-gpu-mi350", labels=["rocm"])\n\n\ndef test_y():\n    pass\n'
    )
    files = {name: yaml.safe_load(text) for name, text in generate(load_catalog(root, pm=pm)).items()}
    job = files["_run-rocm-ci.yml"]["jobs"]["run-rocm"]
    options = job["container"]["options"]
    assert (
        "--env HIP_VISIBLE_DEVICES" in options
        and "--device=/dev/kfd" in options
        and "--device=/dev/dri" in options
    )
    assert [s["id"] for s in job["steps"]][:4] == ["checkout", "wait-driver", "device-check", "install"]
    stage = files["pr-test-self-hosted.yml"]["jobs"]["stage-c-4-gpu-mi350"]
    assert stage["strategy"]["matrix"]["partition"] == [0, 1]  # two files: both shards have work
    assert (stage["with"]["gpus"], stage["with"]["split_host"]) == (4, True)
    assert "github.event.pull_request.head.repo.full_name == github.repository" in stage["if"]
    assert "contains(fromJSON('[\"run-ci-all\",\"run-ci-rocm\"]'), github.event.label.name)" in stage["if"]
    assert stage["with"]["ref"] == "${{ github.event.pull_request.head.sha }}"


def test_one_file_takes_one_runner(tmp_path, pm) -> None:
    root = project(tmp_path, 'register_rocm_ci(600, "stage-c-4-gpu-mi350", labels=["rocm"], num_gpus=4)')
    catalog = load_catalog(root, pm=pm)
    stage = yaml.safe_load(generate(catalog)["pr-test-self-hosted.yml"])["jobs"]["stage-c-4-gpu-mi350"]
    assert stage["strategy"]["matrix"]["partition"] == [0] and stage["with"]["partitions"] == 1
    assert any("declares shards = 2 but has 1 enabled file(s)" in w for w in catalog.warnings_for(None))
