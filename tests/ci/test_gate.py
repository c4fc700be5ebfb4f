"""The self-hosted gate, evaluated on event payloads: which jobs of the generated workflows get a
runner, with which secrets and which commit, for fork and same-repository pull requests (opened,
pushed to, labelled with each label, a fork that edits the workflows), pushes, the schedule and
manual runs; concurrency groups; and the settings the gate relies on."""

from __future__ import annotations

import pytest

from miles_core.ci.register import register_cpu_ci
from miles_core.ci.workflows import GATED_WORKFLOW, PR_WORKFLOW, generate, trust_settings

from .actions_sim import (
    HEAD_SHA,
    MERGE_SHA,
    REPO,
    SECRET,
    dispatch_event,
    pr_event,
    push_event,
    schedule_event,
    simulate,
)

register_cpu_ci(est_time=6, suite="stage-a-cpu")

SUITES = """
[tool.miles.ci]
paths = ["tests"]
secrets = ["HF_TOKEN"]

[tool.miles.ci.labels]
gpu = "a CUDA GPU"
big = "four CUDA GPUs"
slow = "slow CPU test"

[tool.miles.ci.suites.unit]
hardware = "cpu"
runs-on = ["ubuntu-latest"]
shards = 2

[tool.miles.ci.suites.slow]
hardware = "cpu"
runs-on = ["ubuntu-latest"]

[tool.miles.ci.suites.gpu-1]
hardware = "cuda"
runs-on = ["self-hosted", "h200", "1gpu"]
gpus = 1
labels = ["gpu"]
needs = ["unit"]

[tool.miles.ci.suites.gpu-4]
hardware = "cuda"
runs-on = ["self-hosted", "h200", "4gpu"]
gpus = 4
shards = 3
labels = ["big"]

[tool.miles.ci.suites.gpu-nightly]
hardware = "cuda"
runs-on = ["self-hosted", "h200", "1gpu"]
gpus = 1
labels = ["gpu"]
cadence = ["nightly"]

[tool.miles.ci.suites.gpu-empty]
hardware = "cuda"
runs-on = ["self-hosted", "h200", "1gpu"]
gpus = 1
labels = ["gpu"]
"""

SELF_HOSTED = {"gpu-1", "gpu-4", "gpu-nightly"}


@pytest.fixture
def project(tree):
    tree.write("pyproject.toml", '[project]\nname = "demo"\n' + SUITES)
    tree.test_file("tests/test_u1.py", 'register_cpu_ci(5, "unit")')
    tree.test_file("tests/test_u2.py", 'register_cpu_ci(5, "unit")')
    tree.test_file("tests/test_slow.py", 'register_cpu_ci(50, "slow", labels=["slow"])')
    tree.test_file("tests/test_g1.py", 'register_cuda_ci(50, "gpu-1", labels=["gpu"])')
    tree.test_file("tests/test_g4a.py", 'register_cuda_ci(50, "gpu-4", labels=["big"])')
    tree.test_file("tests/test_g4b.py", 'register_cuda_ci(40, "gpu-4", labels=["big"])')
    tree.test_file("tests/test_gn.py", 'register_cuda_ci(50, "gpu-nightly", labels=["gpu"])')
    return tree.catalog()


@pytest.fixture
def files(project) -> dict[str, str]:
    return generate(project)


@pytest.fixture
def allowed(project) -> list[str]:
    """The runner group's selected workflows, as trust_settings prints them."""
    (line,) = [s for s in trust_settings(project) if "'Selected workflows'" in s]
    return [
        ref.replace("OWNER/REPO/.github/workflows/", "").rstrip(",")
        for ref in line.split(": ", 1)[1].split(" (")[0].split(", ")
    ]


def runner_jobs(runs) -> dict[str, object]:
    """Stage name -> the job run that got a runner (a stage's reusable job is 'stage/run-kind')."""
    out = {}
    for run in runs:
        for job in run.jobs:
            if job.on_runner:
                out[(run.workflow, job.job.split("/")[0])] = job
    return out


def self_hosted_stages(runs) -> set[str]:
    return {stage for (_, stage), job in runner_jobs(runs).items() if job.self_hosted}


def sim(files, event, allowed, head=None):
    return simulate(event, files, head, allowed=allowed, secrets=["HF_TOKEN"])


@pytest.mark.parametrize("action", ["opened", "synchronize", "reopened"])
def test_a_forks_commits_never_reach_self_hosted_runners_unapproved(files, allowed, action) -> None:
    runs = sim(files, pr_event(action, ["run-ci-all", "run-ci-gpu", "run-ci-big"], fork=True), allowed)
    assert self_hosted_stages(runs) == set()
    hosted = runner_jobs(runs)
    assert {stage for _, stage in hosted} == {"unit", "slow"}  # GitHub-hosted, pull_request context
    for job in hosted.values():
        assert job.secrets == {"HF_TOKEN": ""} and job.checkout == MERGE_SHA
    assert all(run.workflow == PR_WORKFLOW for run in runs if any(j.on_runner for j in run.jobs))


@pytest.mark.parametrize(
    ("label", "present", "stages"),
    [
        ("run-ci-gpu", [], {"gpu-1"}),
        ("run-ci-big", ["run-ci-gpu"], {"gpu-4"}),  # the label already on the PR is not re-approved
        ("run-ci-all", [], {"gpu-1", "gpu-4"}),  # nightly-only stages never run for pull requests
        ("run-ci-slow", ["run-ci-all"], set()),  # a CPU label starts no self-hosted stage
        ("run-ci-foo", ["run-ci-all"], set()),  # an unknown label neither
        ("bug", ["run-ci-all"], set()),
        ("RUN-CI-GPU", [], {"gpu-1"}),  # label names compare as GitHub compares them
    ],
)
def test_a_label_approves_the_forks_commit_for_its_own_stages(files, allowed, label, present, stages) -> None:
    runs = sim(files, pr_event("labeled", [*present, label], fork=True, label=label), allowed)
    assert self_hosted_stages(runs) == stages
    for (workflow, _), job in runner_jobs(runs).items():
        if job.self_hosted or workflow == GATED_WORKFLOW:
            assert workflow == GATED_WORKFLOW
            assert job.checkout == HEAD_SHA  # exactly the commit the labelled event names
            assert job.secrets == {"HF_TOKEN": ""}, "a fork's code never sees secrets"
            assert job.inputs["pr_labels"] == label  # only the approved label's files run
    if "gpu-1" in stages:  # what gpu-1 needs runs first, in the same (gated) run
        assert (GATED_WORKFLOW, "unit") in runner_jobs(runs)
    if not stages:
        assert not any(j.on_runner for run in runs if run.workflow == GATED_WORKFLOW for j in run.jobs)


def test_a_fork_that_edits_the_workflows_gets_no_self_hosted_runner(files, allowed) -> None:
    def unconditional(text: str) -> str:
        return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("if:")) + "\n"

    head = {name: unconditional(text) for name, text in files.items()}  # every gate deleted
    head["evil.yml"] = (
        "name: evil\n'on':\n  pull_request:\n    types: [opened, synchronize, labeled]\npermissions: {}\njobs:\n"
        "  direct:\n    runs-on: [self-hosted, h200, 4gpu]\n    steps:\n      - run: ./mine.sh\n"
        f"  by-name:\n    uses: {REPO}/.github/workflows/_run-cuda-ci.yml@main\n"
        "    with: {suite: gpu-4, ref: mine, partition: 0, partitions: 1, cadence: regular, pr_labels: '',"
        ' runs_on: \'["self-hosted","h200","4gpu"]\', timeout_minutes: 5, gpus: 4, split_host: false}\n'
    )
    head[GATED_WORKFLOW] = unconditional(files[GATED_WORKFLOW])
    for event in (
        pr_event("synchronize", ["run-ci-all"], fork=True),
        pr_event("labeled", ["run-ci-slow"], fork=True, label="run-ci-slow"),
    ):
        runs = sim(files, event, allowed, head=head)
        asked = {(r.workflow, j.job) for r in runs for j in r.jobs if j.ran and j.self_hosted}
        # the edited files do ask for self-hosted runners ...
        assert ("evil.yml", "direct") in asked and any(w == PR_WORKFLOW for w, _ in asked)
        # ... but the runner group admits none of them, and the default branch's reusable
        # workflow, called by name, skips itself for a caller that is not a generated one
        assert self_hosted_stages(runs) == set()
        by_name = [j for r in runs for j in r.jobs if j.job.startswith("by-name/")]
        assert by_name and not any(j.ran for j in by_name)
        gated = [r for r in runs if r.workflow == GATED_WORKFLOW]
        assert all(not j.on_runner for r in gated for j in r.jobs), "pull_request_target reads the base files"


def test_same_repository_branches_run_their_labels_on_every_push(files, allowed) -> None:
    pushed = sim(files, pr_event("synchronize", ["run-ci-gpu"], fork=False), allowed)
    assert self_hosted_stages(pushed) == {"gpu-1"}
    job = runner_jobs(pushed)[(GATED_WORKFLOW, "gpu-1")]
    assert job.secrets == {"HF_TOKEN": SECRET.format("HF_TOKEN")} and job.checkout == HEAD_SHA
    assert job.inputs["pr_labels"] == ",run-ci-gpu"
    assert self_hosted_stages(sim(files, pr_event("opened", [], fork=False), allowed)) == set()
    # adding a second label runs that label's stages only: gpu-1 already ran for this commit
    added = sim(
        files, pr_event("labeled", ["run-ci-gpu", "run-ci-big"], fork=False, label="run-ci-big"), allowed
    )
    assert self_hosted_stages(added) == {"gpu-4"}
    closed = sim(files, pr_event("closed", ["run-ci-gpu"], fork=False), allowed)
    assert not any(j.on_runner for r in closed for j in r.jobs)


def test_pushes_schedule_and_manual_runs(files, allowed) -> None:
    push = sim(files, push_event(), allowed)
    assert self_hosted_stages(push) == {"gpu-1", "gpu-4"}
    jobs = runner_jobs(push)
    assert all(w == PR_WORKFLOW for w, _ in jobs)
    assert jobs[(PR_WORKFLOW, "gpu-4")].secrets == {"HF_TOKEN": SECRET.format("HF_TOKEN")}
    assert jobs[(PR_WORKFLOW, "gpu-4")].inputs["pr_labels"] == "run-ci-all"
    nightly = sim(files, schedule_event(), allowed)
    assert self_hosted_stages(nightly) == SELF_HOSTED
    assert runner_jobs(nightly)[(PR_WORKFLOW, "gpu-1")].inputs["cadence"] == "nightly"
    assert self_hosted_stages(sim(files, dispatch_event(cadence="nightly"), allowed)) == SELF_HOSTED
    # a manual run of another branch runs its hosted stages only: its workflow file is not trusted
    other = sim(files, dispatch_event("feature", cadence="regular"), allowed)
    assert self_hosted_stages(other) == set() and (PR_WORKFLOW, "unit") in runner_jobs(other)
    assert self_hosted_stages(sim(files, push_event("feature"), allowed)) == set()  # not a trigger


def test_hosted_stages_of_a_pull_request(files, allowed) -> None:
    opened = runner_jobs(sim(files, pr_event("opened", [], fork=False), allowed))
    assert {s for _, s in opened} == {"unit", "slow"}
    assert opened[(PR_WORKFLOW, "unit")].secrets == {"HF_TOKEN": SECRET.format("HF_TOKEN")}
    assert opened[(PR_WORKFLOW, "unit")].inputs["pr_labels"] == ","  # no labels is not every label
    slow = runner_jobs(
        sim(files, pr_event("labeled", ["run-ci-slow"], fork=True, label="run-ci-slow"), allowed)
    )
    assert {s for _, s in slow} == {"slow"}  # the labelled stage again, not the whole workflow
    assert slow[(PR_WORKFLOW, "slow")].inputs["pr_labels"] == ",run-ci-slow"
    assert runner_jobs(sim(files, pr_event("labeled", ["bug"], fork=True, label="bug"), allowed)) == {}


def test_concurrency_one_group_per_pull_request_and_superseded_runs_cancelled(files, allowed) -> None:
    def groups(event) -> dict[str, tuple[str, bool]]:
        return {r.workflow: r.concurrency for r in sim(files, event, allowed)}

    sync = groups(pr_event("synchronize", ["run-ci-gpu"], fork=True))
    gpu = groups(pr_event("labeled", ["run-ci-gpu"], fork=True, label="run-ci-gpu"))
    big = groups(pr_event("labeled", ["run-ci-gpu", "run-ci-big"], fork=True, label="run-ci-big"))
    closed = groups(pr_event("closed", ["run-ci-gpu"], fork=True))
    for workflow in (PR_WORKFLOW, GATED_WORKFLOW):
        assert sync[workflow][1] is True and closed[workflow][1] is True  # a push or close cancels
        assert sync[workflow][0] == closed[workflow][0]
        assert sync[workflow][0].endswith("-pr-5")
    # label runs of one pull request share the group and wait instead of cancelling each other
    assert gpu[GATED_WORKFLOW] == big[GATED_WORKFLOW] == (sync[GATED_WORKFLOW][0], False)
    irrelevant = groups(pr_event("labeled", ["bug"], fork=True, label="bug"))
    assert irrelevant[GATED_WORKFLOW][0] != sync[GATED_WORKFLOW][0]  # it cannot replace a waiting run
    other_pr = groups(pr_event("synchronize", [], fork=True, number=6))
    assert other_pr[GATED_WORKFLOW][0] != sync[GATED_WORKFLOW][0]
    push, nightly = groups(push_event())[PR_WORKFLOW], groups(schedule_event())[PR_WORKFLOW]
    assert push[0] != nightly[0] and push[1] is False  # a push to main never cancels the nightly run


def test_shards_follow_the_files_and_stages_without_files_get_no_job(files, project) -> None:
    import yaml

    pr = yaml.safe_load(files[PR_WORKFLOW])["jobs"]
    assert "gpu-empty" not in pr and "gpu-empty" not in yaml.safe_load(files[GATED_WORKFLOW])["jobs"]
    assert pr["gpu-4"]["strategy"]["matrix"]["partition"] == [0, 1] and pr["gpu-4"]["with"]["partitions"] == 2
    assert pr["unit"]["strategy"]["matrix"]["partition"] == [0, 1]
    assert "#   gpu-empty (cuda): no enabled test files" in files[PR_WORKFLOW]


def test_trust_settings_are_printed_by_the_command_and_stated_in_the_docs(tree, project, cli) -> None:
    from pathlib import Path

    result = cli("ci", "workflows", "--root", str(tree.root), "--out", str(tree.root / "wf"))
    assert result.code == 0
    settings = trust_settings(project)
    assert len(settings) >= 5
    for line in settings:
        assert line in result.out
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "ci.md").read_text().split())
    for phrase in (
        "Selected workflows",
        "Require approval for all external contributors",
        "pull_request_target",
        "Read repository contents",
        "ephemeral",
    ):
        assert phrase in docs
