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


def test_rocm_stages(repo, gh_eval) -> None:
    workflows = repo.root / ".github" / "workflows"
    pr_text = (workflows / PR_WORKFLOW).read_text()
    jobs = yaml.safe_load(pr_text)["jobs"]
    assert "stage-c-4-gpu-mi300x" not in jobs  # disabled: no runnable job, no runners taken
    mi300x = repo.suites["stage-c-4-gpu-mi300x"]
    assert f"#   stage-c-4-gpu-mi300x (rocm): {mi300x.disabled} -- tracking: {mi300x.issue}" in pr_text

    mi350 = jobs["stage-c-4-gpu-mi350"]
    assert mi350["uses"] == "./.github/workflows/_run-rocm-ci.yml"
    assert mi350["strategy"]["matrix"]["partition"] == [0, 1] and mi350["with"]["partitions"] == 2
    assert (mi350["with"]["gpus"], mi350["with"]["split_host"]) == (
        4,
        True,
    )  # two 4-GPU runners per 8-GPU host
    assert yaml.safe_load(mi350["with"]["runs_on"]) == ["self-hosted", "amd", "mi350", "4gpu"]
    fork_push = {
        "event_name": "pull_request",
        "repository": "org/repo",
        "event": {
            "action": "synchronize",
            "pull_request": {"labels": [{"name": "run-ci-rocm"}], "head": {"repo": {"full_name": "x/fork"}}},
        },
    }
    assert not gh_eval(mi350["if"], fork_push)
    fork_push["event"] |= {"action": "labeled", "label": {"name": "run-ci-rocm"}}
    assert gh_eval(mi350["if"], fork_push)

    rocm = yaml.safe_load((workflows / "_run-rocm-ci.yml").read_text())
    assert rocm["permissions"] == {"contents": "read"}
    job = rocm["jobs"]["run-rocm"]
    assert "--env HIP_VISIBLE_DEVICES" in job["container"]["options"]
    assert (
        "--device=/dev/kfd" in job["container"]["options"]
        and "--privileged" not in job["container"]["options"]
    )
    steps = {s["id"]: s for s in job["steps"]}
    assert steps["checkout"]["with"]["persist-credentials"] is False
    assert "HIP_VISIBLE_DEVICES" in steps["device-check"]["run"]
