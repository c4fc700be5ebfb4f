"""Dogfood: this repository's own tests register themselves, its suites load, and its committed
workflows are exactly what `miles ci workflows` generates, with the ROCm stage's shards and
security properties."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from miles_core.ci.register import register_cpu_ci
from miles_core.ci.workflows import PR_WORKFLOW

register_cpu_ci(est_time=4, suite="stage-a-cpu")

pytest.importorskip(
    "miles_rocm", reason="the repository's suites include ROCm stages (install plugins/miles_rocm)"
)


REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(miles_pm_factory):
    import miles_rocm.plugin

    from miles_core.ci.catalog import load_catalog

    pm = miles_pm_factory(builtins=True, plugins=[("miles-rocm", miles_rocm.plugin)])
    return load_catalog(REPO_ROOT, pm=pm)


def test_every_test_file_registers_and_the_suites_load(repo) -> None:
    registered = {r.path for r in repo.registrations}
    assert set(repo.files) == registered
    assert "tests/ci/test_repo_ci.py" in registered
    assert {
        "stage-a-cpu",
        "stage-b-cpu",
        "stage-b-1-gpu-h200",
        "stage-c-4-gpu-mi300x",
        "stage-c-4-gpu-mi350",
    } <= set(repo.suites)


def test_committed_workflows_are_generated_and_lint_clean(repo, cli, lint_workflows) -> None:
    result = cli("ci", "workflows", "--root", str(repo.root), "--check")
    assert result.code == 0, result.out + result.err
    assert lint_workflows(repo.root / ".github" / "workflows") == []
    assert lint_workflows(repo.root / ".github" / "workflows", persona="auditor") == []


def test_rocm_stages(repo) -> None:
    from miles_core.ci.workflows import GATED_WORKFLOW, generate

    from .actions_sim import pr_event, simulate

    workflows = repo.root / ".github" / "workflows"
    pr_text = (workflows / PR_WORKFLOW).read_text()
    jobs = yaml.safe_load(pr_text)["jobs"]
    assert "stage-c-4-gpu-mi300x" not in jobs  # disabled: no runnable job, no runners taken
    mi300x = repo.suites["stage-c-4-gpu-mi300x"]
    assert f"#   stage-c-4-gpu-mi300x (rocm): {mi300x.disabled} -- tracking: {mi300x.issue}" in pr_text

    gated = yaml.safe_load((workflows / GATED_WORKFLOW).read_text())["jobs"]
    mi350 = gated["stage-c-4-gpu-mi350"]
    assert mi350["uses"] == "./.github/workflows/_run-rocm-ci.yml"
    shards = repo.shards("stage-c-4-gpu-mi350")  # min(2 configured, its files): no idle runner
    assert shards == min(2, len(repo.runnable("stage-c-4-gpu-mi350")))
    assert (
        mi350["strategy"]["matrix"]["partition"] == list(range(shards))
        and mi350["with"]["partitions"] == shards
    )
    assert (mi350["with"]["gpus"], mi350["with"]["split_host"]) == (4, True)  # two 4-GPU runners per host
    assert yaml.safe_load(mi350["with"]["runs_on"]) == ["self-hosted", "amd", "mi350", "4gpu"]

    files = generate(repo)

    def rocm_runs(event) -> bool:
        return any(j.on_runner and "mi350" in j.runs_on for r in simulate(event, files) for j in r.jobs)

    assert not rocm_runs(pr_event("synchronize", ["run-ci-rocm"], fork=True))
    assert rocm_runs(pr_event("labeled", ["run-ci-rocm"], fork=True, label="run-ci-rocm"))
    assert not rocm_runs(pr_event("labeled", ["run-ci-rocm", "run-ci-gpu"], fork=True, label="run-ci-gpu"))
    assert not rocm_runs(pr_event("labeled", ["run-ci-all", "run-ci-slow"], fork=True, label="run-ci-slow"))
    assert not rocm_runs(pr_event("labeled", ["run-ci-all", "run-ci-foo"], fork=True, label="run-ci-foo"))

    rocm = yaml.safe_load((workflows / "_run-rocm-ci.yml").read_text())
    assert rocm["permissions"] == {"contents": "read"}
    job = rocm["jobs"]["run-rocm"]
    assert "--env HIP_VISIBLE_DEVICES" in job["container"]["options"]
    assert "@sha256:" in job["container"]["image"]
    assert (
        "--device=/dev/kfd" in job["container"]["options"]
        and "--privileged" not in job["container"]["options"]
    )
    steps = {s["id"]: s for s in job["steps"]}
    assert steps["checkout"]["with"]["persist-credentials"] is False
    assert "HIP_VISIBLE_DEVICES" in steps["device-check"]["run"]
